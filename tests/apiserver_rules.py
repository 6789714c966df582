"""What the Kubernetes API server does with a custom resource before storing it, for the CRD
tests: apply schema defaults, check the OpenAPI schema, and evaluate the CEL rules
(x-kubernetes-validations) with a real CEL implementation. A test helper only: the
authoritative check is a real API server (e2e/ against a cluster)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

CRDS = Path(__file__).resolve().parents[1] / "crds"


def load_crd(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((CRDS / name).read_text()))


def schema_of(crd: dict[str, Any]) -> dict[str, Any]:
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                apply_defaults(sub, obj[name])
    elif isinstance(obj, list) and "items" in schema:
        for item in obj:
            apply_defaults(schema["items"], item)
    return obj


def _cel_errors(schema: dict[str, Any], obj: Any, path: str) -> list[str]:
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        env = celpy.Environment()
        program = env.program(env.compile(rule["rule"]))
        if not bool(program.evaluate({"self": celpy.json_to_cel(obj)})):
            errors.append(f"{path}: Invalid value: {rule.get('message', rule['rule'])}")
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in obj:
                errors += _cel_errors(sub, obj[name], f"{path}.{name}")
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            errors += _cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def admit(crd: dict[str, Any], obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Default and validate like the API server; returns the stored object and the errors,
    each naming its field."""
    schema = schema_of(crd)
    stored = apply_defaults(schema, copy.deepcopy(obj))
    errors = []
    for error in jsonschema.Draft4Validator(schema).iter_errors(stored):
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        errors.append(f"{field.lstrip('.')}: {error.message}")
    if not errors:
        errors = _cel_errors(schema, stored, "")
        errors = [e.lstrip(".") for e in errors]
    return stored, errors
