"""The rules a Kubernetes API server applies to a CustomResourceDefinition's schema before it
accepts the CRD, checked without an API server: the emulated server in the tests accepts any
schema, while a real one refuses a whole CRD over one non-structural node.

Written from Kubernetes' public documentation:

* "Extend the Kubernetes API with CustomResourceDefinitions" (kubernetes.io, tasks):
  "Specifying a structural schema" (a type on every node, nothing but value validation inside
  allOf/anyOf/oneOf/not, every field there also specified outside, metadata restricted to name
  and generateName), "IntOrString" and "RawExtension" (the exceptions), "Validation" (forbidden
  keywords, uniqueItems, additionalProperties), "Defaulting" (defaults pruned and valid against
  their schema), "Validation rules" (rules compile, select only declared fields, oldSelf only on
  correlatable parts) and "Resource use by validation functions" (the cost budget).
* The CustomResourceDefinition v1 API reference, JSONSchemaProps: x-kubernetes-int-or-string,
  -list-type, -list-map-keys, -map-type, -embedded-resource, -preserve-unknown-fields.

Errors read like the API server's: `<path>: <Forbidden|Required value|Invalid value...>: <why>`
with paths such as `spec.validation.openAPIV3Schema.properties[spec].properties[x].type`.

CEL rules are parsed with cel-python, which neither type-checks them nor estimates their cost.
Field selections are checked against the schema; for the cost budget a conservative stand-in
is used instead: a rule must not run once per entry of a list or map without maxItems or
maxProperties, every list or map it iterates needs maxItems or maxProperties, and every string
it compares, matches or searches needs maxLength (an int-or-string field never counts as
bounded: the server's estimate ignores its maxLength). That refuses some rules the server
accepts, such as the documentation's `self.all(x, x == 5)` on a list of integers without
maxItems. The exact cost, type checking of CEL, and anything beyond the documented rules are
checked only by a real API server (e2e/ against a cluster).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import celpy
import jsonschema
from celpy.celparser import CELParseError
from lark import Token, Tree

Schema = dict[str, Any]
Scope = dict[str, tuple[Schema, str]]

JUNCTORS = ("allOf", "anyOf", "oneOf", "not")
INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]
SCALARS = {"string", "integer", "number", "boolean"}
TIME_FORMATS = ("date", "date-time", "duration")
NOT_ALLOWED = (
    "definitions",
    "dependencies",
    "deprecated",
    "discriminator",
    "id",
    "patternProperties",
    "readOnly",
    "writeOnly",
    "xml",
    "$ref",
)
# What a logical junctor may not set (structural rule 3), with the server's wording.
NOT_IN_JUNCTORS = {
    "type": "must be empty to be structural",
    "title": "must be empty to be structural",
    "description": "must be empty to be structural",
    "default": "must be undefined to be structural",
    "additionalProperties": "must be undefined to be structural",
    "nullable": "must be false to be structural",
}
MACROS = {"all", "exists", "exists_one", "map", "filter"}
# String functions whose cost grows with the length of the string.
STRING_FUNCTIONS = {
    "matches",
    "contains",
    "startsWith",
    "endsWith",
    "indexOf",
    "lastIndexOf",
    "lowerAscii",
    "upperAscii",
    "replace",
    "split",
    "substring",
    "trim",
    "find",
    "findAll",
}
COMPARISONS = {
    "relation_eq",
    "relation_ne",
    "relation_lt",
    "relation_le",
    "relation_gt",
    "relation_ge",
}
# Chains of one child that the CEL grammar wraps around every expression.
PASS_THROUGH = {
    "expr",
    "conditionalor",
    "conditionaland",
    "relation",
    "addition",
    "multiplication",
    "unary",
    "member",
    "primary",
    "paren_expr",
}
CEL_RESERVED = {
    *("true", "false", "null", "in", "as", "break", "const", "continue", "else", "for"),
    *("function", "if", "import", "let", "loop", "package", "namespace", "return", "var"),
    *("void", "while"),
}
OBJECT_META: Schema = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "generateName": {"type": "string"}},
}


def _forbidden(path: str, why: str) -> str:
    return f"{path}: Forbidden: {why}"


def _required(path: str, why: str) -> str:
    return f"{path}: Required value: {why}"


def _invalid(path: str, value: Any, why: str) -> str:
    return f"{path}: Invalid value: {json.dumps(value)}: {why}"


def check_crd(crd: Schema) -> list[str]:
    """Every error the API server's documented rules find in the CRD's schemas. A schema shared
    by all versions is reported under spec.validation, as the server does."""
    schemas = [v.get("schema", {}).get("openAPIV3Schema") for v in crd["spec"]["versions"]]
    if schemas and all(s == schemas[0] for s in schemas) and schemas[0] is not None:
        return check_schema(schemas[0], "spec.validation.openAPIV3Schema")
    errors = []
    for i, schema in enumerate(schemas):
        path = f"spec.versions[{i}].schema.openAPIV3Schema"
        errors += [_required(path, "schemas are required")] if schema is None else []
        errors += check_schema(schema, path) if schema is not None else []
    return errors


def check_schema(schema: Schema, path: str = "spec.validation.openAPIV3Schema") -> list[str]:
    errors: list[str] = []
    _check_node(schema, path, "root", [], errors)
    return sorted(errors)


def _check_node(
    s: Schema, path: str, level: str, ancestors: list[tuple[Schema, str]], errors: list[str]
) -> None:
    errors += _keywords(s, path)
    errors += _type(s, path, level)
    errors += _junctors(s, path)
    if level == "root" or s.get("x-kubernetes-embedded-resource"):
        errors += _object_meta(s, path, level == "root")
    errors += _list_and_map_types(s, path)
    if "default" in s:
        errors += _default(s, path)
    errors += _rules(s, path, level, ancestors)
    below = [*ancestors, (s, path)]
    for name, sub in s.get("properties", {}).items():
        _check_node(sub, f"{path}.properties[{name}]", "field", below, errors)
    if isinstance(s.get("additionalProperties"), dict):
        _check_node(
            s["additionalProperties"], f"{path}.additionalProperties", "field", below, errors
        )
    if isinstance(s.get("items"), dict):
        _check_node(s["items"], f"{path}.items", "item", below, errors)


def _keywords(s: Schema, path: str) -> list[str]:
    """The "Validation" section: keywords a CRD schema may not use anywhere."""
    errors = [_forbidden(f"{path}.{k}", "must not be set") for k in NOT_ALLOWED if k in s]
    if s.get("uniqueItems") is True:
        errors.append(_forbidden(f"{path}.uniqueItems", "cannot be set to true"))
    if s.get("additionalProperties") is False:
        errors.append(_forbidden(f"{path}.additionalProperties", "cannot be set to false"))
    if "additionalProperties" in s and "properties" in s:
        errors.append(
            _forbidden(
                f"{path}.additionalProperties",
                "additionalProperties and properties are mutual exclusive",
            )
        )
    if s.get("x-kubernetes-preserve-unknown-fields") is False:
        errors.append(
            _invalid(f"{path}.x-kubernetes-preserve-unknown-fields", False, "must be true or unset")
        )
    if "pattern" in s:
        try:
            re.compile(s["pattern"])
        except re.error as e:
            errors.append(_invalid(f"{path}.pattern", s["pattern"], f"not a valid regexp: {e}"))
    if s.get("x-kubernetes-int-or-string"):
        for other in ("x-kubernetes-preserve-unknown-fields", "x-kubernetes-embedded-resource"):
            if s.get(other):
                errors.append(
                    _invalid(f"{path}.{other}", True, "must be false if x-kubernetes-int-or-string")
                )
    return errors


def _type(s: Schema, path: str, level: str) -> list[str]:
    """Structural rule 1: a non-empty type on the root, every field and every array item, except
    int-or-string nodes and nodes preserving unknown fields; embedded resources are objects."""
    errors = []
    kind = s.get("type")
    if s.get("x-kubernetes-embedded-resource"):
        if kind != "object":
            errors.append(_required(f"{path}.type", "must be object if embedded-resource"))
        if "additionalProperties" in s:
            errors.append(
                _forbidden(f"{path}.additionalProperties", "must not be used if embedded-resource")
            )
        if not s.get("x-kubernetes-preserve-unknown-fields") and not s.get("properties"):
            errors.append(
                _required(
                    f"{path}.properties",
                    "must not be empty if embedded-resource without preserve-unknown-fields",
                )
            )
    elif not kind and not (
        s.get("x-kubernetes-int-or-string") or s.get("x-kubernetes-preserve-unknown-fields")
    ):
        where = {"root": "at the root", "item": "for specified array items"}
        why = where.get(level, "for specified object fields")
        errors.append(_required(f"{path}.type", f"must not be empty {why}"))
    if level == "root" and kind and kind != "object":
        errors.append(_invalid(f"{path}.type", kind, "must be object at the root"))
    if level == "root" and "additionalProperties" in s:
        errors.append(_forbidden(f"{path}.additionalProperties", "must not be used at the root"))
    if kind == "array" and not isinstance(s.get("items"), dict):
        errors.append(_required(f"{path}.items", "must be specified"))
    return errors


def _branches(s: Schema, path: str) -> list[tuple[Schema, str, bool]]:
    """The junctor branches of a node as (branch, path, skip its anyOf), leaving out the two
    exact int-or-string forms the IntOrString section allows."""
    int_or_string = bool(s.get("x-kubernetes-int-or-string"))
    found: list[tuple[Schema, str, bool]] = []
    for key in JUNCTORS:
        value = s.get(key)
        if key == "not" and isinstance(value, dict):
            found.append((value, f"{path}.not", False))
        elif key == "anyOf" and int_or_string and value == INT_OR_STRING:
            continue
        elif isinstance(value, list):
            for i, branch in enumerate(value):
                skip = key == "allOf" and i == 0 and int_or_string
                skip = skip and branch.get("anyOf") == INT_OR_STRING
                found.append((branch, f"{path}.{key}[{i}]", skip))
    return found


def _junctors(s: Schema, path: str) -> list[str]:
    errors: list[str] = []
    for branch, branch_path, skip_any_of in _branches(s, path):
        _nested(branch, branch_path, skip_any_of, errors)
        _projection(branch, s, path, branch_path, errors)
    return errors


def _nested(v: Schema, path: str, skip_any_of: bool, errors: list[str]) -> None:
    """Structural rule 3 (and 4 for metadata): only value validation inside a junctor."""
    errors += _keywords(v, path)
    for key, why in NOT_IN_JUNCTORS.items():
        if key in v and not (key == "nullable" and v[key] is False):
            errors.append(_forbidden(f"{path}.{key}", why))
    for key, value in v.items():
        if key.startswith("x-kubernetes-") and value not in (False, None, [], ""):
            why = "must be false" if value is True else "must be empty"
            if key in ("x-kubernetes-list-type", "x-kubernetes-map-type"):
                why = "must be undefined"
            errors.append(_forbidden(f"{path}.{key}", f"{why} to be structural"))
    if "metadata" in v.get("properties", {}):
        errors.append(
            _forbidden(f"{path}.properties[metadata]", "must not be specified in a nested context")
        )
    for name, sub in v.get("properties", {}).items():
        _nested(sub, f"{path}.properties[{name}]", False, errors)
    if isinstance(v.get("items"), dict):
        _nested(v["items"], f"{path}.items", False, errors)
    for key in JUNCTORS:
        if key == "not" and isinstance(v.get("not"), dict):
            _nested(v["not"], f"{path}.not", False, errors)
        elif key != "not" and not (key == "anyOf" and skip_any_of):
            for i, branch in enumerate(v.get(key, [])):
                _nested(branch, f"{path}.{key}[{i}]", False, errors)


def _projection(v: Schema, s: Schema | None, s_path: str, v_path: str, errors: list[str]) -> None:
    """Structural rule 2: every field or item a junctor mentions is specified outside it too."""
    if s is None:
        errors.append(_required(s_path, f"because it is defined in {v_path}"))
        return
    for name, sub in v.get("properties", {}).items():
        outside = s.get("properties", {}).get(name)
        _projection(
            sub, outside, f"{s_path}.properties[{name}]", f"{v_path}.properties[{name}]", errors
        )
    if isinstance(v.get("items"), dict):
        items = s.get("items") if isinstance(s.get("items"), dict) else None
        _projection(v["items"], items, f"{s_path}.items", f"{v_path}.items", errors)
    for key in JUNCTORS:
        branches = [v[key]] if key == "not" and isinstance(v.get(key), dict) else v.get(key, [])
        for i, branch in enumerate(branches if isinstance(branches, list) else []):
            suffix = key if key == "not" else f"{key}[{i}]"
            _projection(branch, s, s_path, f"{v_path}.{suffix}", errors)


def _object_meta(s: Schema, path: str, root: bool) -> list[str]:
    """Structural rule 4: kind and apiVersion are strings, metadata an object restricted at the
    root only in name and generateName (the server validates metadata itself)."""
    errors = []
    props = s.get("properties", {})
    for name, kind in (("kind", "string"), ("apiVersion", "string"), ("metadata", "object")):
        if name in props and props[name].get("type") != kind:
            typed = props[name].get("type", "")
            errors.append(_invalid(f"{path}.properties[{name}].type", typed, f"must be {kind}"))
    meta = props.get("metadata")
    if root and meta is not None:
        extra = set(meta) - {"type", "properties", "default"}
        extra |= set(meta.get("properties", {})) - {"name", "generateName"}
        if extra:
            errors.append(
                _forbidden(
                    f"{path}.properties[metadata]",
                    "must not specify anything other than name and generateName, "
                    "but metadata is implicitly specified",
                )
            )
    return errors


def _list_and_map_types(s: Schema, path: str) -> list[str]:
    """x-kubernetes-list-type / -list-map-keys / -map-type as the API reference defines them."""
    errors = []
    list_type = s.get("x-kubernetes-list-type")
    keys = s.get("x-kubernetes-list-map-keys")
    items: Schema = s["items"] if isinstance(s.get("items"), dict) else {}
    if list_type is not None and s.get("type") != "array":
        errors.append(_invalid(f"{path}.x-kubernetes-list-type", list_type, "only for arrays"))
    if list_type not in (None, "atomic", "set", "map"):
        errors.append(
            _invalid(
                f"{path}.x-kubernetes-list-type", list_type, 'supported: "atomic", "map", "set"'
            )
        )
    if keys is not None and list_type != "map":
        errors.append(
            _forbidden(
                f"{path}.x-kubernetes-list-map-keys",
                "must not be set if x-kubernetes-list-type is not map",
            )
        )
    if list_type == "map":
        if items.get("type") != "object":
            errors.append(
                _invalid(
                    f"{path}.items.type",
                    items.get("type", ""),
                    "must be object for a list-type map",
                )
            )
        if not keys:
            errors.append(
                _required(
                    f"{path}.x-kubernetes-list-map-keys",
                    "must not be empty if x-kubernetes-list-type is map",
                )
            )
        for key in keys or []:
            prop = items.get("properties", {}).get(key)
            if prop is None or prop.get("type") not in SCALARS:
                errors.append(
                    _invalid(
                        f"{path}.x-kubernetes-list-map-keys",
                        keys,
                        f"{key} must be a scalar-typed property of the items",
                    )
                )
            elif key not in items.get("required", []) and "default" not in prop:
                errors.append(
                    _invalid(
                        f"{path}.x-kubernetes-list-map-keys",
                        keys,
                        f"{key} must be required or have a default value in the items",
                    )
                )
    if list_type == "set":
        atomic = (
            items.get("x-kubernetes-map-type") == "atomic"
            if items.get("type") == "object"
            else None
        )
        if items.get("type") == "array":
            atomic = items.get("x-kubernetes-list-type", "atomic") == "atomic"
        if atomic is False:
            errors.append(
                _invalid(
                    f"{path}.items",
                    items.get("type"),
                    "items of a list-type set must be scalars, atomic maps or atomic lists",
                )
            )
    map_type = s.get("x-kubernetes-map-type")
    if map_type is not None and (
        s.get("type") != "object" or map_type not in ("granular", "atomic")
    ):
        errors.append(
            _invalid(
                f"{path}.x-kubernetes-map-type", map_type, "granular or atomic, on objects only"
            )
        )
    return errors


def _prune(value: Any, s: Schema) -> Any:
    """What the API server stores of value under schema s: unknown fields dropped."""
    if isinstance(value, dict) and (s.get("type") == "object" or "properties" in s):
        props = s.get("properties", {})
        extra = s.get("additionalProperties")
        keep = s.get("x-kubernetes-preserve-unknown-fields") or extra is True
        meta = (
            {"apiVersion", "kind", "metadata"} if s.get("x-kubernetes-embedded-resource") else set()
        )
        pruned = {}
        for key, sub in value.items():
            if key in props:
                pruned[key] = _prune(sub, props[key])
            elif isinstance(extra, dict):
                pruned[key] = _prune(sub, extra)
            elif keep or key in meta:
                pruned[key] = sub
        return pruned
    if isinstance(value, list) and isinstance(s.get("items"), dict):
        return [_prune(item, s["items"]) for item in value]
    return value


def _as_jsonschema(s: Any) -> Any:
    """The node as a draft-4 JSON schema: `nullable: true` admits null."""
    if isinstance(s, list):
        return [_as_jsonschema(x) for x in s]
    if not isinstance(s, dict):
        return s
    out = {k: _as_jsonschema(v) if k != "default" else v for k, v in s.items()}
    if s.get("nullable") is True and "type" in s:
        out["type"] = [s["type"], "null"]
    return out


def _default(s: Schema, path: str) -> list[str]:
    """The "Defaulting" section: a default is pruned already and valid against its own node (a
    null default therefore needs nullable: true)."""
    value = s["default"]
    if _prune(copy.deepcopy(value), s) != value:
        return [_invalid(f"{path}.default", value, "must not have unknown fields")]
    validator = jsonschema.Draft4Validator(_as_jsonschema(s))
    errors = []
    for error in validator.iter_errors(value):
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        errors.append(_invalid(f"{path}.default{where}", value, error.message))
    return errors


def _rules(s: Schema, path: str, level: str, ancestors: list[tuple[Schema, str]]) -> list[str]:
    """The "Validation rules" section: every rule and messageExpression compiles and selects
    only declared fields, oldSelf only where all array ancestors are list-type map, and the
    cost stand-in described in the module docstring."""
    errors: list[str] = []
    scope_node = s
    if level == "root" or s.get("x-kubernetes-embedded-resource"):
        props = {**s.get("properties", {}), "metadata": OBJECT_META}
        props.setdefault("apiVersion", {"type": "string"})
        props.setdefault("kind", {"type": "string"})
        scope_node = {**s, "properties": props}
    unbounded = [p for a, p in ancestors if _unbounded(a)]
    loose = [
        p
        for a, p in ancestors
        if a.get("type") == "array" and a.get("x-kubernetes-list-type") != "map"
    ]
    env = celpy.Environment()
    for i, rule in enumerate(s.get("x-kubernetes-validations", [])):
        rule_path = f"{path}.x-kubernetes-validations[{i}]"
        if not rule.get("rule"):
            errors.append(_required(f"{rule_path}.rule", "rule is not specified"))
        for key in ("rule", "messageExpression"):
            text = rule.get(key)
            if not text:
                continue
            where = f"{rule_path}.{key}"
            try:
                tree = env.compile(text)
            except CELParseError as e:
                at = f"<input>:{getattr(e, 'line', '?')}:{getattr(e, 'column', '?')}"
                errors.append(_invalid(where, text, f"compilation failed: {at}: syntax error"))
                continue
            reach = _Reach()
            reach.visit(tree, {"self": (scope_node, "self"), "oldSelf": (scope_node, "oldSelf")})
            for name in reach.undefined:
                errors.append(
                    _invalid(where, text, f"compilation failed: undefined field '{name}'")
                )
            if reach.uses_old_self and loose:
                errors.append(
                    _invalid(
                        where,
                        text,
                        f"oldSelf cannot be used on the uncorrelatable portion of the schema "
                        f"within {loose[-1]}",
                    )
                )
            causes = list(reach.unbounded)
            if key == "rule":
                causes += [
                    f"the rule runs once per entry of {p}, which has no bound" for p in unbounded
                ]
            for cause in causes:
                errors.append(
                    _forbidden(
                        where,
                        f"estimated rule cost has no bound: {cause} (add maxItems, "
                        "maxProperties and maxLength where lists, maps and strings are used)",
                    )
                )
    return errors


def _unbounded(s: Schema) -> bool:
    if s.get("type") == "array":
        return "maxItems" not in s
    return isinstance(s.get("additionalProperties"), dict) and "maxProperties" not in s


def _strip(tree: Any) -> Any:
    while isinstance(tree, Tree) and tree.data in PASS_THROUGH and len(tree.children) == 1:
        tree = tree.children[0]
    return tree


def _escape(name: str) -> str:
    """A property name as CEL spells it ("Validation rules": escaping)."""
    if name in CEL_RESERVED:
        return f"__{name}__"
    name = name.replace("__", "__underscores__")
    for char, word in ((".", "dot"), ("-", "dash"), ("/", "slash")):
        name = name.replace(char, f"__{word}__")
    return name


class _Reach:
    """What a parsed CEL expression reaches in the schema: selected fields the schema does not
    declare, whether oldSelf is used, and lists, maps and strings whose size its cost depends
    on but which have no bound."""

    def __init__(self) -> None:
        self.undefined: dict[str, None] = {}
        self.unbounded: dict[str, None] = {}
        self.uses_old_self = False

    def resolve(self, tree: Any, scope: Scope) -> tuple[Schema, str] | None:
        tree = _strip(tree)
        if not isinstance(tree, Tree):
            return None
        if tree.data == "ident":
            return scope.get(str(tree.children[0]))
        if tree.data == "member_dot":
            base = self.resolve(tree.children[0], scope)
            return self._field(base, str(tree.children[1])) if base else None
        if tree.data == "member_index":
            base = self.resolve(tree.children[0], scope)
            return _element(base, keys=False) if base else None
        return None

    def _field(self, base: tuple[Schema, str], name: str) -> tuple[Schema, str] | None:
        node, label = base
        if isinstance(node.get("additionalProperties"), dict):
            return node["additionalProperties"], f"{label}.{name}"
        if node.get("type") != "object" and "properties" not in node:
            return None
        props = {_escape(k): v for k, v in node.get("properties", {}).items()}
        if name not in props:
            self.undefined[name] = None
            return None
        return props[name], f"{label}.{name}"

    def _iterated(self, found: tuple[Schema, str] | None) -> None:
        if found and _unbounded(found[0]):
            kind = "maxItems" if found[0].get("type") == "array" else "maxProperties"
            self.unbounded[f"{found[1]} is iterated and has no {kind}"] = None

    def _string(self, found: tuple[Schema, str] | None, how: str) -> None:
        if not found:
            return
        node, label = found
        if node.get("x-kubernetes-int-or-string"):
            cause = f"{label} is {how} and is int-or-string (its length has no bound)"
            self.unbounded[cause] = None
        elif _is_plain_string(node) and "maxLength" not in node:
            self.unbounded[f"{label} is {how} and has no maxLength"] = None

    def visit(self, tree: Any, scope: Scope) -> None:
        if not isinstance(tree, Tree):
            return
        if tree.data == "ident" and str(tree.children[0]) == "oldSelf":
            self.uses_old_self = True
        if tree.data in ("member_dot", "member_index"):
            self.resolve(tree, scope)
        if tree.data == "member_dot_arg":
            target, name = tree.children[0], str(tree.children[1])
            args = tree.children[2].children if len(tree.children) > 2 else []
            found = self.resolve(target, scope)
            variable = _strip(args[0]) if args else None
            if name in MACROS and isinstance(variable, Tree) and variable.data == "ident":
                self._iterated(found)
                var = str(variable.children[0])
                element = _element(found, keys=True) if found else None
                inner = (
                    {**scope, var: (element[0], var)}
                    if element
                    else {k: v for k, v in scope.items() if k != var}
                )
                self.visit(target, scope)
                for arg in args[1:]:
                    self.visit(arg, inner)
                return
            if name in STRING_FUNCTIONS:
                self._string(found, f"searched by {name}()")
                for arg in args:
                    self._string(self.resolve(arg, scope), f"an argument of {name}()")
        if tree.data == "relation" and len(tree.children) == 2:
            op = tree.children[0]
            if isinstance(op, Tree) and op.data == "relation_in":
                self._iterated(_list_only(self.resolve(tree.children[1], scope)))
            elif isinstance(op, Tree) and op.data in COMPARISONS:
                left, right = op.children[0], tree.children[1]
                for side, other in ((left, right), (right, left)):
                    if not _is_number(other):
                        self._string(self.resolve(side, scope), "compared")
        for child in tree.children:
            self.visit(child, scope)


def _element(found: tuple[Schema, str], keys: bool) -> tuple[Schema, str] | None:
    """An item of a list; of a map, a key (what macros iterate) or a value (what indexing
    yields). Keys have no declared length."""
    node, label = found
    if isinstance(node.get("items"), dict):
        return node["items"], f"{label}[*]"
    if isinstance(node.get("additionalProperties"), dict) and keys:
        return {"type": "string"}, f"a key of {label}"
    if isinstance(node.get("additionalProperties"), dict):
        return node["additionalProperties"], f"{label}[*]"
    return None


def _list_only(found: tuple[Schema, str] | None) -> tuple[Schema, str] | None:
    return found if found and found[0].get("type") == "array" else None


def _is_number(tree: Any) -> bool:
    tree = _strip(tree)
    if isinstance(tree, Tree) and tree.data == "unary" and len(tree.children) == 2:
        tree = _strip(tree.children[1])
    if not (isinstance(tree, Tree) and tree.data == "literal"):
        return False
    token = tree.children[0]
    return isinstance(token, Token) and token.type in ("INT_LIT", "UINT_LIT", "FLOAT_LIT")


def _is_plain_string(node: Schema) -> bool:
    """A CEL string: dates, date-times and durations become timestamps and durations."""
    return node.get("type") == "string" and node.get("format") not in TIME_FORMATS
