"""A ValidatingAdmissionPolicy applied to one request as the API server applies it, without
an API server, for testing the chart's policies. Written from Kubernetes' documentation
("Validating Admission Policy", admissionregistration.k8s.io/v1): the request must match the
policy's matchConstraints (resource rules) and every matchCondition; variables are evaluated
in order and seen as `variables.<name>`; each validation that is not true refuses the request
with its message; an expression that fails to evaluate refuses it too under
`failurePolicy: Fail`. CEL is evaluated by cel-python, which does not type-check: a type error
the server would report when the policy is created shows here only when evaluated, and the
server's cost limits are not estimated (a real API server checks both)."""

from __future__ import annotations

from typing import Any

import celpy

Manifest = dict[str, Any]


def expressions(policy: Manifest) -> list[str]:
    """Every CEL expression of the policy."""
    spec = policy["spec"]
    return [
        entry[key]
        for part in ("matchConditions", "variables", "validations")
        for entry in spec.get(part) or []
        for key in ("expression", "messageExpression")
        if entry.get(key)
    ]


def compile_errors(policy: Manifest) -> list[str]:
    env = celpy.Environment()
    errors = []
    for text in expressions(policy):
        try:
            env.compile(text)
        except Exception as exc:  # cel-python's parse errors
            errors.append(f"{text!r}: {exc}")
    return errors


def _matches(policy: Manifest, request: Manifest) -> bool:
    kind = request["resource"]
    for rule in policy["spec"]["matchConstraints"]["resourceRules"]:
        if (
            request["operation"] in rule["operations"]
            and kind["group"] in rule["apiGroups"]
            and kind["version"] in rule["apiVersions"]
            and kind["resource"] in rule["resources"]
        ):
            return True
    return False


def _evaluate(text: str, activation: dict[str, Any]) -> Any:
    env = celpy.Environment()
    result = env.program(env.compile(text)).evaluate(activation)
    if isinstance(result, celpy.CELEvalError):
        raise result
    return result


def admit(policy: Manifest, request: Manifest, obj: Manifest | None) -> list[str] | None:
    """None when the policy does not apply to the request; else the reasons it refuses the
    request ([]: admitted). `request` as an AdmissionReview's request: operation, resource
    (group, version, resource), userInfo."""
    if not _matches(policy, request):
        return None
    spec = policy["spec"]
    fail = spec.get("failurePolicy", "Fail") == "Fail"
    activation: dict[str, Any] = {
        "object": celpy.json_to_cel(obj),
        "oldObject": celpy.json_to_cel(None),
        "request": celpy.json_to_cel(request),
    }
    for condition in spec.get("matchConditions") or []:
        try:
            if not bool(_evaluate(condition["expression"], activation)):
                return None
        except celpy.CELEvalError as exc:
            return [f"matchCondition {condition['name']}: {exc}"] if fail else None
    variables: dict[str, Any] = {}
    reasons = []
    for variable in spec.get("variables") or []:
        activation["variables"] = celpy.json_to_cel(variables)
        try:
            variables[variable["name"]] = _cel_to_json(
                _evaluate(variable["expression"], activation)
            )
        except celpy.CELEvalError as exc:
            variables[variable["name"]] = None
            reasons.append(f"variable {variable['name']}: {exc}")
    activation["variables"] = celpy.json_to_cel(variables)
    for validation in spec.get("validations") or []:
        try:
            ok = bool(_evaluate(validation["expression"], activation))
        except celpy.CELEvalError as exc:
            ok = not fail
            if fail:
                reasons.append(f"{validation.get('message', validation['expression'])}: {exc}")
                continue
        if not ok:
            reasons.append(validation.get("message", validation["expression"]))
    return reasons


def _cel_to_json(value: Any) -> Any:
    if isinstance(value, celpy.celtypes.BoolType):
        return bool(value)
    if isinstance(value, celpy.celtypes.StringType):
        return str(value)
    if isinstance(value, celpy.celtypes.IntType):
        return int(value)
    if isinstance(value, celpy.celtypes.MapType):
        return {_cel_to_json(k): _cel_to_json(v) for k, v in value.items()}
    if isinstance(value, celpy.celtypes.ListType):
        return [_cel_to_json(v) for v in value]
    return value


def create_request(username: str, resource: str = "secrets", group: str = "") -> Manifest:
    return {
        "operation": "CREATE",
        "resource": {"group": group, "version": "v1", "resource": resource},
        "userInfo": {"username": username, "groups": ["system:authenticated"]},
    }
