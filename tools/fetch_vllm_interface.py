"""Extract the Python sources of vLLM's offloading interfaces from the official wheel, for
the test that checks the plug-in against the vLLM version users run (the CPU build tested
here is an older minor version, and the official wheel cannot be imported without CUDA).

The wheel is downloaded once with `pip download --no-deps` into `<target>.wheel/`; from it
only `vllm/v1/kv_offload/` and the vLLM modules those files and the plug-in import are
extracted into the target directory, afresh on every call (a second of work, no download),
so a plug-in importing something new finds it there.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.33.0"
ROOTS = ("vllm/v1/kv_offload/",)
PLUGIN_FILES = ("kvtier/vllm/*.py", "kvtier/api/fingerprint.py")  # the parts using vLLM
COMPLETE = ".complete"


def _module_files(name: str, names: set[str]) -> list[str]:
    """The wheel paths a dotted module name can live at (a module, or a package)."""
    path = name.replace(".", "/")
    return [p for p in (f"{path}.py", f"{path}/__init__.py") if p in names]


def _vllm_imports(source: bytes, package: str) -> set[str]:
    """Dotted vLLM modules a source imports, relative imports resolved against `package`;
    for `from m import n`, m.n too, since n may be a submodule."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m == "vllm" or m.startswith("vllm.")}


def _selection(wheel: zipfile.ZipFile, seeds: set[str]) -> set[str]:
    """`vllm/v1/kv_offload/` and the vLLM modules its files and the plug-in import
    directly: enough to resolve every name the interfaces and the plug-in use."""
    names = set(wheel.namelist())
    keep = {n for n in names if n.endswith(".py") and n.startswith(ROOTS)}
    imported = set(seeds)
    for path in keep:
        package = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        if not path.endswith("__init__.py"):
            package = package.rpartition(".")[0]
        imported |= _vllm_imports(wheel.read(path), package)
    return keep | {f for module in imported for f in _module_files(module, names)}


def _wheel(cache: Path) -> Path:
    found = sorted(cache.glob(f"vllm-{VERSION}-*.whl"))
    if not found:
        with tempfile.TemporaryDirectory(dir=cache.parent) as tmp:
            download = ["download", "-q", "--no-deps", f"vllm=={VERSION}", "-d", tmp]
            subprocess.run([sys.executable, "-m", "pip", *download], check=True)
            cache.mkdir(parents=True, exist_ok=True)
            for wheel in Path(tmp).glob("vllm-*.whl"):
                wheel.rename(cache / wheel.name)  # whole, or not at all
        found = sorted(cache.glob(f"vllm-{VERSION}-*.whl"))
    return found[0]


def main(target: Path, repo: Path) -> None:
    seeds: set[str] = set()
    for pattern in PLUGIN_FILES:
        for plugin in sorted(repo.glob(pattern)):
            seeds |= _vllm_imports(plugin.read_bytes(), "kvtier.agent")
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(_wheel(target.with_name(target.name + ".wheel"))) as wheel:
        keep = _selection(wheel, seeds)
        shutil.rmtree(target, ignore_errors=True)
        for path in sorted(keep):
            out = target / path
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(wheel.read(path))
    (target / COMPLETE).write_text(f"vllm=={VERSION}: {len(keep)} files\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(__file__).resolve().parents[1])
