"""The plug-in payload: the part of kvtier that runs inside vLLM, and nothing else.

The webhook's init container copies /opt/kvtier/plugin into every vLLM pod it injects and puts
it in front of the engine's PYTHONPATH (kvtier/operator/webhook.py). Whatever is in that
directory is importable inside vLLM, so it holds only the plug-in's packages: the contracts
(`kvtier.api`), shared memory (`kvtier.shm`), the agent's client (`kvtier.client`), the plug-in
itself (`kvtier.vllm`), their parents' `__init__.py`, and the plug-in's old module path
(`kvtier.agent.vllm`, which engines configured by 0.1 still name). The agent, the operator, the
CSI plugin, the CLI, the demo and the benchmarks stay out: they need what a vLLM image lacks,
and a pod that could import them could end up depending on them.

This file is the one definition of the payload: the Dockerfile and tools/build_image.sh make
/opt/kvtier/plugin with it, tools/verify_image.py checks the built image against it, and the
tests check the payload's imports against PACKAGES and SHIMS. Only the standard library, so it
runs in any build stage.

    python tools/plugin_payload.py SRC_ROOT DEST

copies the payload from SRC_ROOT (the directory holding `kvtier/`: a source tree or a
site-packages) into DEST, which gets `kvtier/` and must not have one yet.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path, PurePosixPath

# The plug-in's packages, each with all its modules and subpackages.
PACKAGES = ("kvtier.api", "kvtier.shm", "kvtier.client", "kvtier.vllm")
# Single modules outside those packages, kept so that configs naming them still load.
SHIMS = ("kvtier.agent.vllm",)


def _parents(name: str) -> list[str]:
    """`a.b.c` -> [`a`, `a.b`]."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def payload_files(src_root: Path) -> list[PurePosixPath]:
    """The payload's files, relative to `src_root`, sorted. Fails when a package, a shim or a
    parent package the payload names is missing there, so a renamed module breaks the build
    instead of shipping a payload without it."""
    src_root = Path(src_root)
    files: set[PurePosixPath] = set()

    def add(path: Path) -> None:
        if not path.is_file():
            raise FileNotFoundError(f"plug-in payload: {path} is missing")
        files.add(PurePosixPath(path.relative_to(src_root).as_posix()))

    for package in PACKAGES:
        directory = src_root.joinpath(*package.split("."))
        add(directory / "__init__.py")
        for path in directory.rglob("*.py"):
            if "__pycache__" not in path.relative_to(directory).parts:
                add(path)
    for shim in SHIMS:
        add(src_root.joinpath(*shim.split(".")).with_suffix(".py"))
    for name in {parent for module in PACKAGES + SHIMS for parent in _parents(module)}:
        add(src_root.joinpath(*name.split("."), "__init__.py"))
    return sorted(files)


def module_name(path: PurePosixPath) -> str:
    """The module a payload file is: `kvtier/api/__init__.py` -> `kvtier.api`."""
    parts = path.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def payload_modules(src_root: Path) -> list[str]:
    """The payload's modules, sorted: what a vLLM pod can import of kvtier."""
    return sorted(module_name(path) for path in payload_files(src_root))


def copy_payload(src_root: Path, dest: Path) -> list[PurePosixPath]:
    """Copies the payload's files from `src_root` into `dest` (which gets `kvtier/`, and must
    not have one: a payload is made afresh, never merged into an old one). Returns them."""
    src_root, dest = Path(src_root), Path(dest)
    files = payload_files(src_root)
    for top in sorted({path.parts[0] for path in files}):
        if (dest / top).exists():
            raise FileExistsError(f"plug-in payload: {dest / top} exists already")
    for path in files:
        target = dest.joinpath(*path.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src_root.joinpath(*path.parts), target)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src_root", type=Path, help="the directory holding kvtier/")
    parser.add_argument("dest", type=Path, help="the payload directory, e.g. /opt/kvtier/plugin")
    args = parser.parse_args(argv)
    files = copy_payload(args.src_root, args.dest)
    print(f"plug-in payload: {len(files)} files in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
