"""The folder rules (docs/architecture.md), checked on the source so that a change that breaks
them fails here, not in a vLLM pod or an agent container.

- The plug-in's packages (`api`, `shm`, `client`, `vllm`: exactly what the plug-in payload
  ships, `tools/plugin_payload.py`) import only each other, each only those below it, and
  of the rest only the standard library and what a vLLM image has.
- Each other part imports only the parts its row of `MAY_IMPORT` names: the agent never the
  operator, the CSI plugin or the commands; the operator and the CSI plugin only the shared
  contracts and the Kubernetes client; nothing imports `demo/` or `bench/` but the CLI.
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

from tests.payload_tool import payload_tool

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvtier"
HARNESS = ("tests", "e2e", "tools")


PAYLOAD = payload_tool()
# The plug-in's packages, lowest first: each may import those before it.
PLUGIN_PACKAGES = ("kvtier.api", "kvtier.shm", "kvtier.client", "kvtier.vllm")
# What every part may import besides itself (the top-level `kvtier` is the version).
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    **{p: PLUGIN_PACKAGES[:i] for i, p in enumerate(PLUGIN_PACKAGES)},
    "kvtier.kube": (),
    "kvtier.agent": ("kvtier.api", "kvtier.shm", "kvtier.client", "kvtier.kube"),
    "kvtier.operator": ("kvtier.api", "kvtier.kube"),
    "kvtier.csi": ("kvtier.api", "kvtier.kube"),
    "kvtier.local": ("kvtier.api", "kvtier.shm", "kvtier.client"),
    "kvtier.traces": ("kvtier.api", "kvtier.shm", "kvtier.client", "kvtier.agent.host"),
    "kvtier.demo": ("kvtier.api", "kvtier.shm", "kvtier.client", "kvtier.local", "kvtier.traces"),
    "kvtier.bench": (
        "kvtier.api",
        "kvtier.shm",
        "kvtier.client",
        "kvtier.agent",
        "kvtier.csi",
        "kvtier.local",
        "kvtier.traces",
    ),
    "kvtier.cli": (
        "kvtier.api",
        "kvtier.shm",
        "kvtier.client",
        "kvtier.vllm",
        "kvtier.kube",
        "kvtier.agent",
        "kvtier.operator",
        "kvtier.csi",
        "kvtier.local",
        "kvtier.traces",
        "kvtier.demo",
        "kvtier.bench",
    ),
}
# Of what is not the standard library, what a vLLM image brings (vLLM's own requirements).
VLLM_HAS = ("vllm", "torch", "numpy", "zmq", "msgspec", "pydantic", "yaml")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, importer: str = "") -> Iterator[tuple[int, str]]:
    """Every module a file imports, at any depth (lazy imports in functions included), and
    each name a `from` import takes, which may be a module (`from kvtier import agent`);
    relative imports resolved against `importer`, the file's module name."""
    package = importer.split(".") if path.name == "__init__.py" else importer.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if not module:
                continue
            yield node.lineno, module
            yield from ((node.lineno, f"{module}.{alias.name}") for alias in node.names)


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# The packages above the shims, whose `__init__` the payload ships too (`kvtier.agent`).
PAYLOAD_INITS = {s.rsplit(".", 1)[0] for s in PAYLOAD.SHIMS} - {"kvtier"}


def part_of(module: str) -> str | None:
    """The part a kvtier module belongs to: what the payload ships outside the plug-in's
    packages (the plug-in's old module path, its package's `__init__`) is the plug-in's."""
    if within(module, PAYLOAD.SHIMS) or module in PAYLOAD_INITS:
        return "kvtier.vllm"
    return next((p for p in MAY_IMPORT if within(module, (p,))), None)


def refused(importer: str, imported: str) -> bool:
    part = part_of(importer)
    if part is None or not within(imported, ("kvtier",)) or imported == "kvtier":
        return False
    if imported == "kvtier.__version__" or within(imported, (part,)):
        return False
    return not within(imported, MAY_IMPORT[part])


def violations() -> list[str]:
    found = []
    for name, path in product_modules().items():
        if part_of(name) is None and name != "kvtier":
            found.append(f"{name} is in no part: give it a folder and a row in MAY_IMPORT")
        lines = {n: m for n, m in imports(path, name) if refused(name, m)}
        found += [f"{name}:{n} imports {m}" for n, m in lines.items()]
    return found


def test_parts_import_only_what_their_folder_rule_allows() -> None:
    assert violations() == []


def page_rules(page: str) -> dict[str, set[str]]:
    """The import-rules table of docs/architecture.md, as MAY_IMPORT's parts and sets."""
    rows = page.split("| part | may import of kvtier |", 1)[1].split("\n\n", 1)[0]
    rules = {}
    for row in rows.strip().splitlines()[1:]:
        part, allowed = (cell.strip() for cell in row.strip("|").split("|"))
        name = "kvtier." + part.split("`")[1].removesuffix(".py")
        if allowed == "every part":
            rules[name] = set(MAY_IMPORT) - {name}
        else:
            rules[name] = {f"kvtier.{p}" for p in allowed.split("`")[1::2]}
    return rules


def test_the_page_states_the_rules_the_test_holds() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert page_rules(page) == {part: set(allowed) for part, allowed in MAY_IMPORT.items()}


def test_the_page_check_fails_when_the_page_differs() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    changed = page.replace("| `operator` | `api`, `kube` |", "| `operator` | `api`, `agent` |")
    assert changed != page and page_rules(changed)["kvtier.operator"] != set(
        MAY_IMPORT["kvtier.operator"]
    )


def test_the_plugin_packages_are_the_payload() -> None:
    assert tuple(PAYLOAD.PACKAGES) == PLUGIN_PACKAGES


def test_the_product_never_uses_tests_e2e_or_tools() -> None:
    found = []
    for name, path in product_modules().items():
        found += [f"{name}:{n} imports {m}" for n, m in imports(path, name) if within(m, HARNESS)]
        for node in ast.walk(ast.parse(path.read_text())):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and any(text.startswith(f"{h}.") for h in HARNESS):
                found.append(f"{name}:{node.lineno} names the module {text}")
    assert found == []


def test_the_harness_check_fails_when_broken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "x.py"
    path.write_text("from tests.helpers import x\nRUN = 'tools.verify_image'\n")
    monkeypatch.setattr("tests.test_architecture.product_modules", lambda: {"kvtier.x": path})
    with pytest.raises(AssertionError, match=r"imports tests\.helpers"):
        test_the_product_never_uses_tests_e2e_or_tools()


def foreign_in_plugin() -> list[str]:
    """Imports in the plug-in's packages of anything neither the standard library nor vLLM's
    environment has (at any depth: a lazy import runs in vLLM's process too)."""
    found = []
    for name, path in product_modules().items():
        if part_of(name) not in PLUGIN_PACKAGES:
            continue
        lines: dict[int, str] = {}
        for n, imported in imports(path, name):
            top = imported.split(".")[0]
            if top in ("kvtier", "__future__") or top in sys.stdlib_module_names:
                continue
            if top not in VLLM_HAS:
                lines.setdefault(n, imported)
        found += [f"{name}:{n} imports {m}" for n, m in lines.items()]
    return found


def test_the_plugin_imports_only_what_vllm_has() -> None:
    assert foreign_in_plugin() == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("kvtier.api.x", "from kvtier.shm.pool import Pool\n", "imports kvtier.shm.pool"),
        ("kvtier.shm.x", "from kvtier.client.protocol import Lookup\n", "imports kvtier.client"),
        ("kvtier.client.x", "import kvtier.vllm.tier\n", "imports kvtier.vllm.tier"),
        ("kvtier.vllm.x", "def f():\n    import kvtier.agent.server\n", "imports kvtier.agent"),
        ("kvtier.agent.vllm", "from kvtier.agent.host.tier import HostTier\n", "kvtier.agent"),
        ("kvtier.agent.x", "from kvtier.operator import builders\n", "imports kvtier.operator"),
        ("kvtier.agent.host.x", "def f():\n    import kvtier.cli.main\n", "imports kvtier.cli"),
        ("kvtier.agent.x", "from kvtier.vllm.tier import X\n", "imports kvtier.vllm.tier"),
        ("kvtier.operator.x", "from kvtier.bench.host import run\n", "imports kvtier.bench"),
        ("kvtier.operator.x", "from kvtier.agent.server import X\n", "imports kvtier.agent"),
        ("kvtier.csi.x", "from kvtier.operator.webhook import X\n", "imports kvtier.operator"),
        ("kvtier.traces.x", "import kvtier.demo.main\n", "imports kvtier.demo"),
        ("kvtier.demo.x", "from kvtier.bench.runner import X\n", "imports kvtier.bench"),
        ("kvtier.bench.x", "from kvtier.demo.peers import X\n", "imports kvtier.demo"),
        ("kvtier.local.x", "from kvtier.agent.server import X\n", "imports kvtier.agent"),
        ("kvtier.kube", "from kvtier.api.config import X\n", "imports kvtier.api"),
        ("kvtier.stray", "import os\n", "kvtier.stray is in no part"),
        ("kvtier.vllm.x", "from kvtier import agent\n", "imports kvtier.agent"),
        ("kvtier.vllm.x", "from ..agent import server\n", "imports kvtier.agent"),
        ("kvtier.shm.x", "from . import pool\nfrom ..client import protocol\n", "kvtier.client"),
        ("kvtier.agent", "from kvtier.agent.host import tier\n", "imports kvtier.agent.host"),
    ],
)
def test_the_folder_check_fails_when_broken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, source: str, expected: str
) -> None:
    path = tmp_path / "x.py"
    path.write_text(source)
    monkeypatch.setattr(
        "tests.test_architecture.product_modules", lambda: {module: path}, raising=True
    )
    (found,) = violations()
    assert expected in found


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("kvtier.shm.x", "import xxhash\n"),
        ("kvtier.client.x", "def f():\n    import boto3\n"),
        ("kvtier.api.x", "from lightkube import Client\n"),
        ("kvtier.agent.vllm", "import kopf\n"),
        ("kvtier.agent", "import kopf\n"),
    ],
)
def test_the_vllm_environment_check_fails_when_broken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, source: str
) -> None:
    path = tmp_path / "x.py"
    path.write_text(source)
    monkeypatch.setattr("tests.test_architecture.product_modules", lambda: {module: path})
    (found,) = foreign_in_plugin()
    assert found.startswith(f"{module}:")


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


def numpy_loaded_by(modules: list[str], path: Path | None = None) -> bool:
    """Whether importing `modules` (in a fresh interpreter, `path` first on its path) loads
    numpy."""
    code = (
        f"import sys; sys.path[:0] = {[str(path)] if path else []!r}\n"
        f"for m in {modules!r}: __import__(m)\n"
        "print('numpy' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip() == "True"


def test_the_operator_loads_no_numpy(tmp_path: Path) -> None:
    operator = ["kvtier.operator.builders", "kvtier.operator.webhook", "kvtier.operator.status"]
    assert not numpy_loaded_by(operator)
    (tmp_path / "planted_operator.py").write_text("import kvtier.shm.pool\n")
    assert numpy_loaded_by([*operator, "planted_operator"], tmp_path)
