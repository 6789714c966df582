"""The plug-in payload (tools/plugin_payload.py) imported where it runs: a vLLM pod, with the
payload on PYTHONPATH and nothing else of kvtier.

The webhook's init container copies /opt/kvtier/plugin into the pod and puts it in front of the
engine's PYTHONPATH (kvtier/operator/webhook.py, `_with_env`). So the check copies the payload
with the tool into a directory, and runs a python whose environment is this one's (vLLM, torch
and what they bring) less kvtier, with that directory as PYTHONPATH. There:

- every module of the payload imports, `kvtier.vllm.tier` (which imports vLLM) included;
- the agent, operator, CSI plugin, CLI, demo, benchmarks, traces, local runner and kube helpers
  are not importable (ModuleNotFoundError), nor is any other kvtier module outside the payload;
- every kvtier module loaded was loaded from the payload;
- a transfer config of 0.1, naming `"module_path": "kvtier.agent.vllm"`, still loads: vLLM's
  CLI parses it, its offloading spec's metric definitions load the tier through
  `SecondaryTierFactory` (what vLLM does when it builds the connector's metrics), and the class
  is `kvtier.vllm.tier.KVTierSecondaryTier`.

The environment without kvtier: kvtier is installed editable into .venv-vllm, by a `.pth` file
(`__editable__.kvtier-*.pth`) that appends setuptools' `__editable___kvtier_*_finder` to
`sys.meta_path`, plus a `kvtier-*.dist-info`. That finder resolves `kvtier.<anything>` to the
repository even when `kvtier` itself came from the payload, so it must not be there; hiding it
with `-S` and a partial `site` set-up would change how the interpreter starts. Instead the check
makes a venv of the same base interpreter (`venv`, no pip), whose site-packages holds a symlink
to every entry of this environment's site-packages except kvtier's. That python starts as a
pod's does (site, .pth files, no kvtier distribution), and a control test asserts it cannot
find `kvtier` or its distribution, so a change in how kvtier gets installed fails here loudly
instead of letting the check pass against the repository. It runs with `-c` in an empty
directory, so the working directory adds nothing either.

The check fails when something else is reachable: the same check, run with an extra module in
the payload, the repository ahead of it on PYTHONPATH, or kvtier's editable install visible,
reports it (test_the_check_reports_what_else_is_reachable).
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from kvtier.api.config import parse_config
from kvtier.api.transfer_config import (
    PLUGIN_HOME,
    PLUGIN_MODULE,
    build_kv_transfer_config,
    kv_transfer_config_arg,
)
from tests.payload_tool import payload_tool

REPO = Path(__file__).resolve().parents[2]
OLD_MODULE = "kvtier.agent.vllm"  # the plug-in's module path in 0.1's transfer configs
# What never runs inside vLLM, by name; the check also tries every other kvtier module.
ABSENT = (
    "kvtier.agent.server",
    "kvtier.operator",
    "kvtier.csi",
    "kvtier.cli.main",
    "kvtier.demo",
    "kvtier.bench",
    "kvtier.traces",
    "kvtier.local",
    "kvtier.kube",
)


payload = payload_tool()


# Runs in the vLLM-image python: reads a job (JSON, argv[1]), writes a report (argv[2]).
CHECK = r"""
import importlib, importlib.util, json, os, sys

with open(sys.argv[1]) as f:
    job = json.load(f)
root = os.path.realpath(job["payload"]) + os.sep
problems = []
configs = {}


def missing(name, exc):
    # ModuleNotFoundError for the module itself or a package above it: not reachable. For
    # anything else (a dependency of a module that was found) the module was reachable.
    return bool(exc.name) and (name == exc.name or name.startswith(exc.name + "."))


# First, before anything imports the plug-in: each transfer config as an engine loads it.
for label, arg in job["configs"].items():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    parsed = EngineArgs.from_cli_args(parser.parse_args(["--kv-transfer-config", arg]))
    extra = parsed.kv_transfer_config.kv_connector_extra_config
    tier_config = extra["secondary_tiers"][0]
    module_path = tier_config["module_path"]
    loaded_before = module_path in sys.modules
    spec_cls = OffloadingSpecFactory.get_spec_cls(extra)
    metrics = spec_cls.build_metric_definitions(extra)
    tier_cls = SecondaryTierFactory.get_tier_class(tier_config)
    from kvtier.vllm.tier import KVTierSecondaryTier

    configs[label] = {
        "module_path": module_path,
        "loaded_before": loaded_before,
        "module_file": sys.modules[module_path].__file__,
        "spec": spec_cls.__name__,
        "tier": f"{tier_cls.__module__}.{tier_cls.__qualname__}",
        "is_plugin_class": tier_cls is KVTierSecondaryTier,
        "tier_metrics_defined": set(tier_cls.build_metric_definitions(tier_config)) <= set(metrics),
    }

for name in job["import"]:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        problems.append(f"payload module {name} does not import: {exc!r}")

for name in job["absent"]:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if not missing(name, exc):
            problems.append(f"{name} is reachable: found, then {exc!r}")
    except BaseException as exc:
        problems.append(f"{name} is reachable: found, then {exc!r}")
    else:
        problems.append(f"{name} is reachable: imported from {sys.modules[name].__file__}")

for name in job["unreachable"]:
    try:
        found = importlib.util.find_spec(name)
    except ModuleNotFoundError as exc:
        if not missing(name, exc):
            problems.append(f"{name} is reachable: its package imports, then {exc!r}")
    except BaseException as exc:
        problems.append(f"{name} is reachable: its package imports, then {exc!r}")
    else:
        if found is not None:
            problems.append(f"{name} is reachable: {found.origin}")

for name, module in sorted(sys.modules.items()):
    if module is None or not (name == "kvtier" or name.startswith("kvtier.")):
        continue
    file = getattr(module, "__file__", None)
    if not file or not os.path.realpath(file).startswith(root):
        problems.append(f"{name} loaded from outside the payload: {file}")

with open(sys.argv[2], "w") as f:
    json.dump({"problems": problems, "configs": configs}, f)
"""


def vllm_image_python(dest: Path, *, hide_kvtier: bool = True) -> Path:
    """A venv at `dest` of this interpreter's base python whose site-packages links to every
    entry of this environment's (vLLM's) site-packages, kvtier's own left out unless
    `hide_kvtier` is false (to show what leaking it does)."""
    venv.EnvBuilder(symlinks=True, with_pip=False, clear=True).create(dest)
    (dest / "cwd").mkdir()  # an empty working directory for it
    target = dest / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    assert target.is_dir(), target
    for source in map(Path, site.getsitepackages()):
        if not source.is_dir():
            continue
        for entry in sorted(source.iterdir()):
            if hide_kvtier and _is_kvtiers(entry):
                continue
            if not (target / entry.name).exists():
                (target / entry.name).symlink_to(entry)
    return dest / "bin" / "python"


def _is_kvtiers(entry: Path) -> bool:
    """kvtier's own entries in a site-packages: its package, its distribution's metadata, and
    an editable install's `.pth` file and finder (or any `.pth` naming the repository)."""
    if "kvtier" in entry.name.lower():
        return True
    return entry.suffix == ".pth" and str(REPO) in entry.read_text(errors="replace")


def _env(pythonpath: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.pop("VIRTUAL_ENV", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return env


def _run(
    python: Path, code: str, *args: str, pythonpath: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-c", code, *args],
        cwd=cwd or python.parents[1] / "cwd",
        env=_env(pythonpath),
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )


@pytest.fixture(scope="module")
def image_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vllm_image_python(tmp_path_factory.mktemp("vllm-image") / "venv")


def old_and_new_configs() -> dict[str, str]:
    """The `--kv-transfer-config` the operator injects (naming 0.1's module path, as 0.1
    did), and the same naming the module the plug-in lives in."""
    agent = parse_config({"name": "old", "host": {"capacity": "64Mi", "chunkBytes": "256Ki"}})
    old = build_kv_transfer_config(agent, cpu_bytes_to_use=1 << 30)
    new = json.loads(json.dumps(old))
    [injected] = old["kv_connector_extra_config"]["secondary_tiers"]
    assert injected["module_path"] == PLUGIN_MODULE == OLD_MODULE
    [tier] = new["kv_connector_extra_config"]["secondary_tiers"]
    tier["module_path"] = PLUGIN_HOME
    return {"old": kv_transfer_config_arg(old), "new": kv_transfer_config_arg(new)}


def check(
    python: Path,
    plugin_dir: Path,
    work: Path,
    *,
    pythonpath: str | None = None,
    with_vllm: bool = True,
) -> dict[str, Any]:
    """Runs CHECK in `python` with `plugin_dir` as PYTHONPATH (or `pythonpath`). Without
    `with_vllm`, leaves out what imports vLLM (the plug-in's modules, the configs): faster,
    for the cases that show what the rest of the check reports."""
    modules = sorted(
        payload.module_name(PurePosixPath(path.relative_to(plugin_dir).as_posix()))
        for path in plugin_dir.rglob("*.py")
    )
    if not with_vllm:
        modules = [
            m
            for m in modules
            if not (m == "kvtier.vllm" or m.startswith("kvtier.vllm.") or m in payload.SHIMS)
        ]
    shipped = set(payload.payload_modules(REPO))
    others = sorted(
        payload.module_name(PurePosixPath(path.relative_to(REPO).as_posix()))
        for path in (REPO / "kvtier").rglob("*.py")
        if "__pycache__" not in path.parts
    )
    job = {
        "payload": str(plugin_dir),
        "import": modules,
        "absent": list(ABSENT),
        "unreachable": [m for m in others if m not in shipped and m not in ABSENT],
        "configs": old_and_new_configs() if with_vllm else {},
    }
    (work / "job.json").write_text(json.dumps(job))
    empty = work / "cwd"
    empty.mkdir()
    run = _run(
        python,
        CHECK,
        str(work / "job.json"),
        str(work / "report.json"),
        pythonpath=str(plugin_dir) if pythonpath is None else pythonpath,
        cwd=empty,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report: dict[str, Any] = json.loads((work / "report.json").read_text())
    return report


def test_the_environment_is_vllms_without_kvtier(image_python: Path) -> None:
    """The control: without the payload, this python has vLLM and no kvtier at all."""
    run = _run(
        image_python,
        "import importlib.util as u, importlib.metadata as m\n"
        "print(u.find_spec('vllm') is not None, u.find_spec('torch') is not None)\n"
        "print(u.find_spec('kvtier'))\n"
        "try:\n    m.distribution('kvtier')\nexcept m.PackageNotFoundError:\n    print('none')\n",
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:3] == ["True True", "None", "none"], run.stdout


def test_the_payload_imports_alone_and_an_old_transfer_config_loads(
    image_python: Path, tmp_path: Path
) -> None:
    plugin_dir = tmp_path / "plugin"
    payload.copy_payload(REPO, plugin_dir)
    report = check(image_python, plugin_dir, tmp_path)
    assert report["problems"] == []
    old, new = report["configs"]["old"], report["configs"]["new"]
    assert old["module_path"] == OLD_MODULE and new["module_path"] == PLUGIN_HOME
    # vLLM itself imported the old module path, and got the plug-in's class from it
    assert not old["loaded_before"]
    assert old["module_file"] == str(plugin_dir / "kvtier/agent/vllm.py")
    for config in (old, new):
        assert config["spec"] == "TieringOffloadingSpec"
        assert config["tier"] == "kvtier.vllm.tier.KVTierSecondaryTier"
        assert config["is_plugin_class"] and config["tier_metrics_defined"]


def _copied(relative: str) -> Any:
    def leak(plugin_dir: Path) -> None:
        shutil.copyfile(REPO / relative, plugin_dir / relative)

    return leak


def _repo_first(plugin_dir: Path) -> str:
    return f"{REPO}{os.pathsep}{plugin_dir}"


# A module of the agent that the explicit list does not name: the scan of every other kvtier
# module must find it.
_UNNAMED = min(
    p.relative_to(REPO).as_posix()
    for p in (REPO / "kvtier/agent").glob("*.py")
    if not p.name.startswith("_") and p.name not in ("vllm.py", "server.py")
)


@pytest.mark.parametrize(
    ("leak", "expected"),
    [
        pytest.param(
            _copied("kvtier/agent/server.py"),
            ["kvtier.agent.server is reachable"],
            id="agent-server-in-payload",
        ),
        pytest.param(
            _copied(_UNNAMED),
            [f"{payload.module_name(PurePosixPath(_UNNAMED))} is reachable"],
            id="other-agent-module-in-payload",
        ),
        pytest.param(
            _repo_first,
            ["kvtier.operator is reachable", "kvtier loaded from outside the payload"],
            id="repository-ahead-on-pythonpath",
        ),
        pytest.param(None, ["kvtier.operator is reachable"], id="editable-install-visible"),
    ],
)
def test_the_check_reports_what_else_is_reachable(
    image_python: Path, tmp_path: Path, leak: Any, expected: list[str]
) -> None:
    """The same check, with one way each of letting more than the payload be reachable:
    an extra module copied into it, the repository ahead of it on PYTHONPATH, or the python
    built without hiding kvtier's editable install (whose finder serves `kvtier.operator`
    though `kvtier` came from the payload)."""
    plugin_dir = tmp_path / "plugin"
    payload.copy_payload(REPO, plugin_dir)
    python = image_python
    pythonpath = None
    if leak is None:
        python = vllm_image_python(tmp_path / "leaky", hide_kvtier=False)
    else:
        pythonpath = leak(plugin_dir)
    report = check(python, plugin_dir, tmp_path, pythonpath=pythonpath, with_vllm=False)
    for what in expected:
        assert any(p.startswith(what) for p in report["problems"]), report["problems"]


def test_the_payload_is_the_plugin_packages_and_their_parents() -> None:
    files = payload.payload_files(REPO)
    modules = {payload.module_name(f) for f in files}
    parents = {"kvtier", "kvtier.agent"}
    assert set(payload.SHIMS) | parents <= modules
    for module in modules - parents - set(payload.SHIMS):
        assert any(module == p or module.startswith(p + ".") for p in payload.PACKAGES), module
    # every module of each package, and of the agent only the shim
    for package in payload.PACKAGES:
        directory = REPO.joinpath(*package.split("."))
        on_disk = {
            PurePosixPath(p.relative_to(REPO).as_posix())
            for p in directory.rglob("*.py")
            if "__pycache__" not in p.parts
        }
        assert on_disk <= set(files), package
    assert sorted(f.name for f in files if f.parent == PurePosixPath("kvtier/agent")) == [
        "__init__.py",
        "vllm.py",
    ]


def test_the_tool_copies_only_the_payloads_python_files(tmp_path: Path) -> None:
    """From a tree holding all of kvtier, caches and stray files included, the CLI copies
    the payload's .py files and nothing else; it refuses to merge into an old payload."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "kvtier", src / "kvtier", ignore=shutil.ignore_patterns("__pycache__"))
    (src / "kvtier/api/__pycache__").mkdir()
    (src / "kvtier/api/__pycache__/config.cpython-311.pyc").write_bytes(b"")
    (src / "kvtier/api/__pycache__/stale.py").write_text("")
    (src / "kvtier/shm/notes.txt").write_text("")
    dest = tmp_path / "plugin"
    tool = [sys.executable, str(REPO / "tools/plugin_payload.py"), str(src), str(dest)]
    run = subprocess.run(tool, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    copied = sorted(
        PurePosixPath(p.relative_to(dest).as_posix()) for p in dest.rglob("*") if p.is_file()
    )
    assert copied == payload.payload_files(REPO)
    again = subprocess.run(tool, capture_output=True, text=True, check=False)
    assert again.returncode != 0 and "exists already" in again.stderr


def test_the_tool_fails_when_a_package_is_missing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(REPO / "kvtier", src / "kvtier", ignore=shutil.ignore_patterns("__pycache__"))
    (src / "kvtier/agent/vllm.py").unlink()
    with pytest.raises(FileNotFoundError, match=r"agent/vllm\.py"):
        payload.copy_payload(src, tmp_path / "plugin")
    shutil.rmtree(src / "kvtier/shm")
    with pytest.raises(FileNotFoundError, match="shm"):
        payload.payload_files(src)
