"""The direction of imports (docs/architecture.md), checked on the source so that a change
that breaks it fails here, not in a vLLM pod or an agent container.

- Of kvtier, the agent imports only itself, the shared Kubernetes client and the version: it
  runs in its own container and its plug-in runs inside vLLM.
- The operator never imports the CLIs, the demo, the benchmarks, replay, plan or the CSI
  plugin.
- The vLLM plug-in imports only what vLLM's environment has.
- Nothing in the product imports, or runs as a module, the tests, e2e scenarios or tools.
- No module but the host tier takes the host tier's lock or reads its index: the others use
  its narrow interface (`HostTier.subscribe`, `pin_locked`, `events_since`, ...).
- The operator loads no numpy: the config model it imports describes the pool without it.
- No test or e2e module imports a test module (`tests.test_*`): what tests share lives in a
  helper module named for what it holds.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvtier"
HARNESS = ("tests", "e2e", "tools")
# Of kvtier, the agent imports only itself, the shared Kubernetes client and the version.
AGENT_MAY_IMPORT = (
    "kvtier.agent",
    "kvtier.api",
    "kvtier.shm",
    "kvtier.client",
    "kvtier.vllm",
    "kvtier.kube",
    "kvtier.__version__",
)
OPERATOR_MAY_NOT_IMPORT = (
    "kvtier.cli.main",
    "kvtier.cli.kubectl",
    "kvtier.demo.main",
    "kvtier.demo.peers",
    "kvtier.demo.vllm",
    "kvtier.demo.engines",
    "kvtier.bench",
    "kvtier.local.agent",
    "kvtier.traces.replay",
    "kvtier.traces.plan",
    "kvtier.csi",
)
# The plug-in and what it imports run in vLLM's environment: numpy, pyzmq, msgspec, xxhash
# come with vLLM; nothing that talks to Kubernetes, S3 or NIXL may be imported there.
PLUGIN = "kvtier.vllm.tier"
NOT_IN_VLLM = ("kopf", "kubernetes", "lightkube", "boto3", "botocore", "nixl", "grpc", "rich")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """Every module a file imports, at any depth (lazy imports in functions included)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{a.name}") for a in node.names)


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def refused(importer: str, imported: str) -> bool:
    if within(importer, ("kvtier.agent",)):
        return (
            within(imported, ("kvtier",))
            and imported != "kvtier"
            and (not within(imported, AGENT_MAY_IMPORT))
        )
    return within(importer, ("kvtier.operator",)) and within(imported, OPERATOR_MAY_NOT_IMPORT)


def violations() -> list[str]:
    found = []
    for name, path in product_modules().items():
        lines = {n: m for n, m in imports(path) if refused(name, m)}
        found += [f"{name}:{n} imports {m}" for n, m in lines.items()]
    return found


def test_parts_import_in_one_direction() -> None:
    assert violations() == []


def test_the_product_never_uses_tests_e2e_or_tools() -> None:
    found = []
    for name, path in product_modules().items():
        found += [f"{name}:{n} imports {m}" for n, m in imports(path) if within(m, HARNESS)]
        for node in ast.walk(ast.parse(path.read_text())):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and any(text.startswith(f"{h}.") for h in HARNESS):
                found.append(f"{name}:{node.lineno} names the module {text}")
    assert found == []


def plugin_closure() -> set[str]:
    """The kvtier modules the plug-in loads at import time (module level only)."""
    modules = product_modules()
    seen: set[str] = set()
    todo = [PLUGIN]
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        tree = ast.parse(modules[name].read_text())
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                todo += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
    return seen


def test_the_plugin_imports_only_what_vllm_has() -> None:
    closure = plugin_closure()
    assert PLUGIN in closure and len(closure) > 3
    modules = product_modules()
    found = [
        f"{name} imports {imported}"
        for name in sorted(closure)
        for node in ast.parse(modules[name].read_text()).body
        if isinstance(node, ast.Import | ast.ImportFrom)
        for _, imported in imports_of(node)
        if within(imported, NOT_IN_VLLM) or within(imported, ("kvtier.demo.engines",))
    ]
    assert found == []


def imports_of(node: ast.Import | ast.ImportFrom) -> list[tuple[int, str]]:
    if isinstance(node, ast.Import):
        return [(node.lineno, a.name) for a in node.names]
    return [(node.lineno, node.module or "")]


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("kvtier.agent.x", "from kvtier.operator import builders\n", "imports kvtier.operator"),
        ("kvtier.agent.x", "def f():\n    import kvtier.cli.main\n", "imports kvtier.cli.main"),
        ("kvtier.operator.x", "from kvtier.bench.host import run\n", "imports kvtier.bench"),
        ("kvtier.agent.x", "from kvtier.cli.trace import load\n", "imports kvtier.cli.trace"),
        ("kvtier.operator.x", "import kvtier.demo.peers\n", "imports kvtier.demo.peers"),
    ],
)
def test_the_check_fails_when_broken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, source: str, expected: str
) -> None:
    path = tmp_path / "x.py"
    path.write_text(source)
    monkeypatch.setattr(
        "tests.test_architecture.product_modules", lambda: {module: path}, raising=True
    )
    (found,) = violations()
    assert expected in found


def named_test_module(name: str) -> str | None:
    """The test module (`tests.test_agent`, `.test_agent`) a dotted import names, if any."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.startswith("test_") and (i == 0 or parts[0] in HARNESS or parts[0] == ""):
            return ".".join(parts[: i + 1])
    return None


def imported_test_modules(source: str) -> list[tuple[int, str]]:
    """The test modules a source imports, at any depth, relative imports included."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            sep = "." if node.module else ""
            names = [base] + [f"{base}{sep}{a.name}" for a in node.names]
        else:
            continue
        found |= {(node.lineno, m) for m in map(named_test_module, names) if m}
    return sorted(found)


def harness_files() -> list[Path]:
    return sorted(p for part in ("tests", "e2e") for p in (ROOT / part).rglob("*.py"))


def test_no_test_module_imports_another() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n} imports {m}"
        for path in harness_files()
        for n, m in imported_test_modules(path.read_text())
    ]
    assert found == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from tests.test_agent import scrape\n", "tests.test_agent"),
        ("import tests.test_chart\n", "tests.test_chart"),
        ("def f():\n    from tests.test_peers import peer_stats\n", "tests.test_peers"),
        ("from .test_agent import scrape\n", ".test_agent"),
        ("from tests import test_agent\n", "tests.test_agent"),
        ("from . import test_agent\n", ".test_agent"),
        ("from tests.vllm.test_plugin import x\n", "tests.vllm.test_plugin"),
    ],
)
def test_the_test_import_check_fails_when_broken(source: str, expected: str) -> None:
    assert expected in {m for _, m in imported_test_modules(source)}


def test_the_test_import_check_fails_on_a_planted_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planted = tmp_path / "test_planted.py"
    planted.write_text("from tests.test_agent import scrape\n")
    monkeypatch.setattr("tests.test_architecture.ROOT", tmp_path)
    monkeypatch.setattr("tests.test_architecture.harness_files", lambda: [planted])
    with pytest.raises(AssertionError, match=r"test_planted\.py:1 imports tests\.test_agent"):
        test_no_test_module_imports_another()


def test_the_test_import_check_allows_helper_modules() -> None:
    source = (
        "from tests.agent_helpers import scrape\nfrom tests import netns\nimport tests.helpers\n"
    )
    assert imported_test_modules(source) == []


HOST_TIER = "kvtier.agent.host.tier"
HOST_INTERNALS = {"lock", "index", "_lock", "_index", "_on_sealed", "_on_hits", "on_sealed"}


def _is_host(node: ast.expr) -> bool:
    """`host`, `self.host`, `self.server.host`, `agent._host`: a reference to a HostTier."""
    if isinstance(node, ast.Name):
        return node.id in {"host", "_host"}
    return isinstance(node, ast.Attribute) and node.attr in {"host", "_host"}


def host_internals_used() -> list[str]:
    found = []
    for name, path in product_modules().items():
        if name == HOST_TIER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or node.attr not in HOST_INTERNALS:
                continue
            if _is_host(node.value):
                found.append(f"{name}:{node.lineno} uses the host tier's {node.attr}")
    return found


def test_only_the_host_tier_takes_its_lock_or_reads_its_index() -> None:
    assert host_internals_used() == []


@pytest.mark.parametrize(
    "source",
    [
        "def f(self):\n    with self.host.lock:\n        pass\n",
        "def f(host):\n    return host.index.get('ns', b'k')\n",
        "def f(self):\n    self.server.host._index.pin(None)\n",
    ],
)
def test_the_host_check_fails_when_broken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    path = tmp_path / "x.py"
    path.write_text(source)
    monkeypatch.setattr("tests.test_architecture.product_modules", lambda: {"kvtier.x": path})
    assert len(host_internals_used()) == 1


def test_the_operator_loads_no_numpy() -> None:
    code = (
        "import sys\n"
        "import kvtier.operator.builders, kvtier.operator.webhook, kvtier.operator.status\n"
        "assert 'numpy' not in sys.modules, 'numpy loaded'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
