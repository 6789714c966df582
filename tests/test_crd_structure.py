"""The CRDs pass the API server's documented rules for CustomResourceDefinitions (structural
schema, defaults, list types, CEL rules and a stand-in for their cost budget), as shipped in
crds/ and as the chart renders them, and schemas a real API server refuses are refused here
with the server's path and reason."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart_render import render
from tests.crd_rules import check_crd

CRDS = sorted((Path(__file__).resolve().parents[1] / "crds").glob("*.yaml"))
ROOT = "spec.validation.openAPIV3Schema"
SPEC = f"{ROOT}.properties[spec]"
INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]

# spec.host.capacity of crds/kvcachetier.yaml when a kube-apiserver v1.36 refused the whole CRD
# ("anyOf[0].type: Forbidden: must be empty to be structural").
REFUSED_CAPACITY = r"""
description: Bytes of host memory per node, e.g. 64Gi.
x-kubernetes-int-or-string: true
anyOf: [{type: integer, minimum: 1}, {type: string}]
pattern: '^([1-9][0-9]*(\.[0-9]+)?|0\.[0-9]*[1-9][0-9]*)([KMGTPE]i|[kMGTPE])?$'
"""


def crd(spec: dict[str, Any], **root: Any) -> dict[str, Any]:
    """A one-version CRD whose spec has the given properties and whose root schema has the
    given extra properties."""
    schema = {
        "type": "object",
        "properties": {"spec": {"type": "object", "properties": spec}, **root},
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {
            "group": "example.com",
            "scope": "Namespaced",
            "names": {"kind": "Widget", "plural": "widgets"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def rule(text: str, **schema: Any) -> dict[str, Any]:
    return {**schema, "x-kubernetes-validations": [{"rule": text}]}


STRING = {"type": "string"}


def obj(properties: dict[str, Any], **schema: Any) -> dict[str, Any]:
    """An object schema with the given properties and further keywords."""
    return {"type": "object", "properties": properties, **schema}


def named_list(list_type: str, **schema: Any) -> dict[str, Any]:
    """A list of `{name: string}` objects with the given list type and further keywords."""
    return {
        "type": "array",
        "x-kubernetes-list-type": list_type,
        **schema,
        "items": obj({"name": STRING}),
    }


@pytest.mark.parametrize("path", CRDS, ids=[p.name for p in CRDS])
def test_shipped_crds_pass(path: Path) -> None:
    assert check_crd(yaml.safe_load(path.read_text())) == []


class _StrictLoader(yaml.SafeLoader):
    """YAML as kubectl (sigs.k8s.io/yaml) and Helm read it: a key twice in one mapping is an
    error ("mapping key already defined"), where PyYAML keeps the last silently."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
        repeated = {k for k in keys if keys.count(k) > 1}
        if repeated:
            raise yaml.constructor.ConstructorError(
                None, None, f"mapping key {sorted(repeated)} already defined", node.start_mark
            )
        return super().construct_mapping(node, deep=deep)


REPO = Path(__file__).resolve().parent.parent
YAML_FILES = [*CRDS, *sorted((REPO / "charts" / "kvtier").glob("*.yaml"))]


@pytest.mark.parametrize("path", YAML_FILES, ids=[p.name for p in YAML_FILES])
def test_no_key_is_defined_twice(path: Path) -> None:
    list(yaml.load_all(path.read_text(), Loader=_StrictLoader))


def test_a_key_defined_twice_is_refused() -> None:
    with pytest.raises(yaml.constructor.ConstructorError, match="already defined"):
        yaml.load("a:\n  b: 1\na:\n  c: 2\n", Loader=_StrictLoader)


def test_crds_the_chart_renders_pass() -> None:
    rendered = [o for o in render() if o["kind"] == "CustomResourceDefinition"]
    assert len(rendered) == len(CRDS)
    for definition in rendered:
        assert check_crd(definition) == [], definition["metadata"]["name"]


def test_kvcachetier_as_refused_by_a_real_server_fails_here() -> None:
    tier = yaml.safe_load(next(p for p in CRDS if p.name == "kvcachetier.yaml").read_text())
    schema = tier["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema["properties"]["spec"]["properties"]["host"]["properties"]["capacity"] = yaml.safe_load(
        REFUSED_CAPACITY
    )
    assert (
        f"{SPEC}.properties[host].properties[capacity].anyOf[0].type: "
        "Forbidden: must be empty to be structural"
    ) in check_crd(tier)


BOUNDED_NAME = {"type": "string", "maxLength": 63}
REFUSED = [
    pytest.param(
        crd({"capacity": yaml.safe_load(REFUSED_CAPACITY)}),
        f"{SPEC}.properties[capacity].anyOf[0].type: Forbidden: must be empty to be structural",
        id="minimum-inside-int-or-string-anyOf",
    ),
    pytest.param(
        crd({"count": {"minimum": 1}}),
        f"{SPEC}.properties[count].type: Required value: "
        "must not be empty for specified object fields",
        id="field-without-type",
    ),
    pytest.param(
        crd({"size": {"type": "integer", "allOf": [{"type": "integer", "minimum": 1}]}}),
        f"{SPEC}.properties[size].allOf[0].type: Forbidden: must be empty to be structural",
        id="type-inside-allOf",
    ),
    pytest.param(
        crd({"mode": obj({"a": STRING}, **{"not": {"properties": {"b": {"pattern": "^x$"}}}})}),
        f"{SPEC}.properties[mode].properties[b]: Required value: "
        f"because it is defined in {SPEC}.properties[mode].not.properties[b]",
        id="properties-inside-not-only",
    ),
    pytest.param(
        crd({}, metadata=obj({"labels": {"type": "object", "maxProperties": 3}})),
        f"{ROOT}.properties[metadata]: Forbidden: must not specify anything other than name "
        "and generateName, but metadata is implicitly specified",
        id="metadata-restricts-labels",
    ),
    pytest.param(
        crd({"replicas": {"type": "integer", "minimum": 1, "default": 0}}),
        f"{SPEC}.properties[replicas].default: Invalid value: 0: 0 is less than the minimum of 1",
        id="default-violates-its-schema",
    ),
    pytest.param(
        crd({"opts": obj({"a": STRING}, default={"a": "x", "b": 1})}),
        f'{SPEC}.properties[opts].default: Invalid value: {{"a": "x", "b": 1}}: '
        "must not have unknown fields",
        id="default-with-unknown-fields",
    ),
    pytest.param(
        crd({"ports": named_list("map")}),
        f"{SPEC}.properties[ports].x-kubernetes-list-map-keys: Required value: "
        "must not be empty if x-kubernetes-list-type is map",
        id="list-map-without-keys",
    ),
    pytest.param(
        crd({"ports": named_list("map", **{"x-kubernetes-list-map-keys": ["name"]})}),
        "name must be required or have a default value",
        id="list-map-key-optional",
    ),
    pytest.param(
        crd({"peers": named_list("set")}),
        f'{SPEC}.properties[peers].items: Invalid value: "object": items of a list-type set',
        id="list-set-of-granular-objects",
    ),
    pytest.param(
        crd({"a": rule("self >", type="integer")}),
        f'{SPEC}.properties[a].x-kubernetes-validations[0].rule: Invalid value: "self >": '
        "compilation failed",
        id="rule-does-not-compile",
    ),
    pytest.param(
        crd(
            {
                "w": rule(
                    "self.nonExistingField > 0",
                    type="object",
                    properties={"foo": {"type": "integer"}},
                )
            }
        ),
        "compilation failed: undefined field 'nonExistingField'",
        id="rule-selects-undeclared-field",
    ),
    pytest.param(
        crd(
            {
                "foo": rule(
                    "self.all(x, x.contains('a string'))", type="array", items={"type": "string"}
                )
            }
        ),
        f"{SPEC}.properties[foo].x-kubernetes-validations[0].rule: Forbidden: estimated rule "
        "cost has no bound: self is iterated and has no maxItems",
        id="rule-iterates-unbounded-list",
    ),
    pytest.param(
        crd(
            {
                "names": rule(
                    "self.all(n, n.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'))",
                    type="array",
                    maxItems=100,
                    items={"type": "string"},
                )
            }
        ),
        "estimated rule cost has no bound: n is searched by matches() and has no maxLength",
        id="rule-matches-unbounded-string",
    ),
    pytest.param(
        crd(
            {
                "tiers": {
                    "type": "array",
                    "maxItems": 8,
                    "items": {
                        "type": "object",
                        "properties": {
                            "size": rule(
                                "type(self) == string ? self.matches('^[0-9]+(Ki|Mi|Gi)$') "
                                ": self > 0",
                                **{"x-kubernetes-int-or-string": True},
                                anyOf=INT_OR_STRING,
                                maxLength=16,
                            )
                        },
                    },
                }
            }
        ),
        "self is searched by matches() and is int-or-string (its length has no bound)",
        id="rule-matches-int-or-string",
    ),
    pytest.param(
        crd(
            {
                "foo": {
                    "type": "array",
                    "items": rule("self.all(x, x == 5)", type="array", items={"type": "integer"}),
                }
            }
        ),
        f"the rule runs once per entry of {SPEC}.properties[foo], which has no bound",
        id="rule-in-nested-unbounded-lists",
    ),
    pytest.param(
        crd(
            {
                "list": {
                    "type": "array",
                    "maxItems": 4,
                    "items": rule(
                        "self.n >= oldSelf.n", type="object", properties={"n": {"type": "integer"}}
                    ),
                }
            }
        ),
        "oldSelf cannot be used on the uncorrelatable portion of the schema within "
        f"{SPEC}.properties[list]",
        id="transition-rule-in-atomic-list",
    ),
    pytest.param(
        crd({"labels": obj({"app": STRING}, additionalProperties=STRING)}),
        f"{SPEC}.properties[labels].additionalProperties: Forbidden: "
        "additionalProperties and properties are mutual exclusive",
        id="properties-and-additionalProperties",
    ),
]


@pytest.mark.parametrize(("definition", "expected"), REFUSED)
def test_schema_a_real_server_refuses_is_refused(definition: dict[str, Any], expected: str) -> None:
    errors = check_crd(definition)
    assert any(expected in e for e in errors), errors


ACCEPTED = [
    pytest.param(
        crd(
            {
                "foo": {"type": "string", "pattern": "abc"},
                "bar": {"type": "integer"},
                "baz": {
                    "type": "object",
                    "properties": {"bar": {"type": "integer"}},
                    "anyOf": [{"properties": {"bar": {"minimum": 42}}, "required": ["bar"]}],
                },
            },
            metadata={
                "type": "object",
                "properties": {"name": {"type": "string", "pattern": "^a"}},
            },
        ),
        id="docs-structural-example",
    ),
    pytest.param(
        crd(
            {
                "x": {
                    "x-kubernetes-int-or-string": True,
                    "allOf": [{"anyOf": INT_OR_STRING}, {"pattern": "^[0-9]+%?$"}],
                }
            }
        ),
        id="int-or-string-allOf-form",
    ),
    pytest.param(
        crd(
            {
                "size": rule(
                    "type(self) == int ? self > 0 : true",
                    **{"x-kubernetes-int-or-string": True},
                    anyOf=INT_OR_STRING,
                    pattern="^[0-9]+(Ki|Mi|Gi)?$",
                )
            }
        ),
        id="int-or-string-bound-in-cel",
    ),
    pytest.param(
        crd(
            {
                "foo": rule(
                    "self.all(x, x.contains('a string'))",
                    type="array",
                    maxItems=25,
                    items={"type": "string", "maxLength": 10},
                ),
                "labels": rule(
                    "self.all(k, self[k].size() < 64)",
                    type="object",
                    maxProperties=10,
                    additionalProperties=BOUNDED_NAME,
                ),
            }
        ),
        id="bounded-lists-maps-strings",
    ),
    pytest.param(
        crd(
            {
                "conditions": {
                    "type": "array",
                    "x-kubernetes-list-type": "map",
                    "x-kubernetes-list-map-keys": ["type"],
                    "maxItems": 8,
                    "items": rule(
                        "self.status == oldSelf.status || self.type != 'Frozen'",
                        type="object",
                        required=["type"],
                        properties={
                            "type": BOUNDED_NAME,
                            "status": {"type": "string", "enum": ["True", "False"], "maxLength": 5},
                        },
                    ),
                },
                "modes": {
                    "type": "array",
                    "x-kubernetes-list-type": "set",
                    "items": {"type": "string"},
                    "default": ["a", "b"],
                },
            }
        ),
        id="list-types-and-transition-rule-in-list-map",
    ),
]


@pytest.mark.parametrize("definition", ACCEPTED)
def test_schema_the_docs_allow_is_accepted(definition: dict[str, Any]) -> None:
    assert check_crd(definition) == []


def test_versions_with_different_schemas_are_reported_per_version() -> None:
    definition = crd({"count": {"minimum": 1}})
    second = copy.deepcopy(definition["spec"]["versions"][0])
    second |= {"name": "v2", "storage": False}
    second["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["count"] = {
        "type": "integer"
    }
    definition["spec"]["versions"].append(second)
    assert check_crd(definition) == [
        "spec.versions[0].schema.openAPIV3Schema.properties[spec].properties[count].type: "
        "Required value: must not be empty for specified object fields"
    ]
