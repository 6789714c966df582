"""Write docs/configuration.md from the CRD schemas, so the reference never drifts from
what the API server enforces (tests/test_docs.py checks it is current)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


def _type(schema: dict[str, Any]) -> str:
    if schema.get("x-kubernetes-int-or-string"):
        return "quantity"
    kind = schema.get("type", "object")
    if kind == "array":
        return f"[]{_type(schema.get('items', {}))}"
    return str(kind)


def _rows(schema: dict[str, Any], path: str) -> list[str]:
    rows = []
    required = set(schema.get("required", []))
    for name, sub in schema.get("properties", {}).items():
        field = f"{path}.{name}" if path else name
        extras = []
        if name in required:
            extras.append("required")
        if "default" in sub:
            default = yaml.safe_dump(sub["default"], default_flow_style=True)
            extras.append(f"default `{default.strip().removesuffix('...').strip()}`")
        if "enum" in sub:
            extras.append("one of " + ", ".join(f"`{v}`" for v in sub["enum"]))
        for rule in sub.get("x-kubernetes-validations", []):
            extras.append(f"rule: {rule.get('message', rule['rule'])}")
        description = " ".join(str(sub.get("description", "")).split())
        note = f" ({'; '.join(extras)})" if extras else ""
        rows.append(f"| `{field}` | {_type(sub)} | {description}{note} |")
        target = sub.get("items", sub) if sub.get("type") == "array" else sub
        rows += _rows(target, f"{field}[]" if sub.get("type") == "array" else field)
    return rows


def render() -> str:
    parts = [
        "# Configuration reference",
        "",
        "Generated from `crds/` by `tools/crd_reference.py`; `kubectl explain` shows the same.",
        "",
    ]
    for path in sorted((REPO / "crds").glob("*.yaml"), reverse=True):
        crd = yaml.safe_load(path.read_text())
        names = crd["spec"]["names"]
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        parts += [
            f"## {names['kind']} (`{crd['spec']['group']}/{crd['spec']['versions'][0]['name']}`, "
            f"short name `{names['shortNames'][0]}`)",
            "",
            " ".join(str(schema.get("description", "")).split()),
            "",
            "| field | type | meaning |",
            "| --- | --- | --- |",
            *_rows(schema["properties"]["spec"], "spec"),
            "",
        ]
    return "\n".join(parts)


if __name__ == "__main__":
    target = REPO / "docs" / "configuration.md"
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if target.read_text() == render() else 1)
    target.write_text(render())
