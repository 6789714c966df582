"""The plug-in against the offloading interfaces of the vLLM version users run.

The engines here run vLLM's CPU build of an older minor version; pods run the official
wheel, which cannot be imported without CUDA. So its sources (extracted once by
tools/fetch_vllm_interface.py, which `make test` runs) are read, not imported, and the
plug-in's source is checked against them: every abstract method implemented with a
compatible signature, the constructor accepting what vLLM's tier factory passes and what
the injected config adds, every name imported from vLLM defined there, and every field
read from vLLM's job and config records present.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.api.config import AgentConfig
from kvtier.api.transfer_config import build_kv_transfer_config

REPO = Path(__file__).resolve().parents[2]
INTERFACE = Path(os.environ.get("KVTIER_VLLM_INTERFACE", REPO / ".venv-vllm" / "vllm-interface"))
PLUGIN = REPO / "kvtier" / "vllm" / "tier.py"
FINGERPRINT = REPO / "kvtier" / "api" / "fingerprint.py"
# every module of the plug-in that imports vLLM: vllm.py and its parts, and the fingerprint
VLLM_USERS = [
    path
    for path in [*sorted(PLUGIN.parent.glob("*.py")), FINGERPRINT]
    if "from vllm" in path.read_text() or "import vllm" in path.read_text()
]


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def vllm_source(module: str) -> ast.Module:
    base = INTERFACE / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return parse(path)
    raise AssertionError(f"vLLM 0.33 has no module {module}")


@pytest.fixture(scope="module", autouse=True)
def interface() -> None:
    if not (INTERFACE / ".complete").exists():
        pytest.fail(
            f"vLLM 0.33's sources are not at {INTERFACE}: `make test` extracts them "
            "(tools/fetch_vllm_interface.py)"
        )


def class_def(module: ast.Module, name: str) -> ast.ClassDef:
    (found,) = [n for n in module.body if isinstance(n, ast.ClassDef) and n.name == name]
    return found


def methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def decorators(fn: ast.FunctionDef) -> set[str]:
    return {ast.unparse(d).rpartition(".")[2] for d in fn.decorator_list}


def positional(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]


def top_level_names(module: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in module.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).partition(".")[0] for a in node.names}
        elif isinstance(node, ast.If | ast.Try):  # TYPE_CHECKING blocks, guarded imports
            names |= top_level_names(ast.Module(body=node.body, type_ignores=[]))
    return names


def vllm_imports(module: ast.Module) -> Iterator[tuple[str, str]]:
    for node in ast.walk(module):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
            for alias in node.names:
                yield str(node.module), alias.name


def base_methods() -> dict[str, ast.FunctionDef]:
    return methods(
        class_def(vllm_source("vllm.v1.kv_offload.tiering.base"), "SecondaryTierManager")
    )


def plugin_methods() -> dict[str, ast.FunctionDef]:
    return methods(class_def(parse(PLUGIN), "KVTierSecondaryTier"))


def test_every_abstract_method_is_implemented() -> None:
    abstract = {n for n, fn in base_methods().items() if "abstractmethod" in decorators(fn)}
    assert abstract  # the interface was read
    assert abstract - set(plugin_methods()) == set()


def test_overridden_methods_keep_vllms_signatures() -> None:
    base, ours = base_methods(), plugin_methods()
    for name in (set(base) & set(ours)) - {"__init__"}:
        theirs, mine = base[name], ours[name]
        kinds = {"classmethod", "staticmethod", "property"}
        assert decorators(theirs) & kinds == decorators(mine) & kinds, name
        expected = positional(theirs)
        assert positional(mine)[: len(expected)] == expected, name  # callers may use names
        extra = len(positional(mine)) - len(expected)
        assert extra <= len(mine.args.defaults), f"{name}: extra parameters need defaults"
        assert bool(theirs.args.vararg) <= bool(mine.args.vararg), name
        assert bool(theirs.args.kwarg) <= bool(mine.args.kwarg), name


def test_constructor_accepts_what_the_factory_and_the_injected_config_pass(
    make_config: Callable[..., AgentConfig],
) -> None:
    factory = vllm_source("vllm.v1.kv_offload.tiering.factory")
    (call,) = [
        n
        for n in ast.walk(factory)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "tier_cls"
    ]
    passed = {k.arg for k in call.keywords if k.arg is not None}
    assert {"offloading_spec", "primary_kv_view", "tier_type"} <= passed
    assert any(k.arg is None for k in call.keywords)  # **config: the tier's own keys

    injected = build_kv_transfer_config(make_config(), cpu_bytes_to_use=1 << 20, scope="team")
    (tier,) = injected["kv_connector_extra_config"]["secondary_tiers"]
    passed |= set(tier) - {"type", "module_path"}  # what the factory pops
    init = plugin_methods()["__init__"]
    accepted = set(positional(init)) | {a.arg for a in init.args.kwonlyargs}
    assert passed - accepted == set()
    required = positional(init)[1 : len(positional(init)) - len(init.args.defaults)]
    assert set(required) <= passed


def test_every_part_of_the_plugin_that_uses_vllm_is_checked() -> None:
    names = {path.name for path in VLLM_USERS}
    assert {"tier.py", "events.py", "metrics.py", "fingerprint.py"} <= names


@pytest.mark.parametrize("source", VLLM_USERS, ids=lambda p: p.name)
def test_names_imported_from_vllm_exist_there(source: Path) -> None:
    imports = list(vllm_imports(parse(source)))
    assert imports
    for module, name in imports:
        submodule = INTERFACE / module.replace(".", "/") / name
        is_submodule = submodule.with_suffix(".py").exists() or (submodule / "__init__.py").exists()
        assert name in top_level_names(vllm_source(module)) or is_submodule, (
            f"vLLM 0.33 has no {module}.{name}"
        )


@pytest.mark.parametrize("source", VLLM_USERS, ids=lambda p: p.name)
def test_attributes_of_imported_vllm_modules_exist_there(source: Path) -> None:
    """`from vllm import config as m` ... `m.VllmConfig`: the attribute is checked too
    (a getattr with a default is the plug-in's guard for names older versions lack)."""
    tree = parse(source)
    aliases = {
        alias.asname or alias.name: f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm")
        for alias in node.names
        if (INTERFACE / str(node.module).replace(".", "/") / alias.name).is_dir()
        or (INTERFACE / str(node.module).replace(".", "/") / f"{alias.name}.py").exists()
    }
    used = [
        (aliases[n.value.id], n.attr)
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
    ]
    for module, name in used:
        assert name in top_level_names(vllm_source(module)), f"vLLM 0.33 has no {module}.{name}"


def dataclass_fields(module: str, cls: str) -> list[str]:
    body = class_def(vllm_source(module), cls).body
    return [
        n.target.id for n in body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    ]


def test_job_records_have_the_fields_the_plugin_uses() -> None:
    tiering = "vllm.v1.kv_offload.tiering.base"
    job_fields = set(dataclass_fields(tiering, "TransferJob"))
    result_fields = dataclass_fields(tiering, "JobResult")
    plugin = parse(PLUGIN)
    used = {
        n.attr
        for n in ast.walk(plugin)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id in ("job", "job_metadata")
    }
    assert used and used <= job_fields
    calls = [
        n
        for n in ast.walk(plugin)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "JobResult"
    ]
    assert calls
    for call in calls:
        assert len(call.args) <= len(result_fields)
        assert {k.arg for k in call.keywords} <= set(result_fields)


def test_offloading_config_has_the_fields_the_fingerprint_reads() -> None:
    """Attribute chains the fingerprint reads from vLLM's OffloadingConfig, followed
    through the annotated types of its fields."""
    config = "vllm.v1.kv_offload.config"
    roots = {"offloading_config": "OffloadingConfig", "config": "OffloadingConfig"}
    for node in ast.walk(parse(FINGERPRINT)):
        if not isinstance(node, ast.Attribute):
            continue
        chain: list[str] = []
        value: ast.expr = node
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in roots:
            continue
        cls = roots[value.id]
        for attr in chain:
            body = class_def(vllm_source(config), cls).body
            annotations = {
                n.target.id: ast.unparse(n.annotation)
                for n in body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            }
            assert attr in annotations, f"vLLM 0.33's {cls} has no field {attr}"
            cls = annotations[attr].removeprefix("tuple[").split(",")[0].rstrip("]")
            if not cls.startswith("Offloading"):
                break


def test_kv_events_have_the_residency_fields_the_plugin_sets() -> None:
    """The plug-in's events name the tier's medium and locality and, where vLLM has the
    field (`hasattr`-style guard in kvtier/vllm/events.py), the node as `ownership`: 0.33's
    OffloadingEvent has all three, and its Medium and Locality the values the agent sends."""
    base = vllm_source("vllm.v1.kv_offload.base")
    fields = dataclass_fields("vllm.v1.kv_offload.base", "OffloadingEvent")
    assert {"keys", "medium", "removed", "locality", "ownership"} <= set(fields)

    def members(name: str) -> set[str]:
        return {
            t.id
            for n in class_def(base, name).body
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name)
        }

    from kvtier.agent.host.events import POOL, RESIDENCY_OF_KIND

    assert {r.medium for r in [POOL, *RESIDENCY_OF_KIND.values()]} <= members("Medium")
    assert {r.locality for r in [POOL, *RESIDENCY_OF_KIND.values()]} <= members("Locality")
    source = (PLUGIN.parent / "events.py").read_text()
    assert '"ownership"' in source and "HAS_OWNERSHIP" in source
