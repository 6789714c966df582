"""The CSI v1 messages and services the node plugin serves (Identity and Node), declared from
the CSI specification (container-storage-interface/spec, `csi.proto`, package `csi.v1`) with
the same field numbers, so kubelet's requests decode exactly as in any CSI driver. Built as
protobuf descriptors at import, which spares a code generator and generated files; only the
messages these two services use are declared, and unknown fields a newer kubelet sends are
kept by protobuf and ignored here."""

from __future__ import annotations

from typing import Any

from google.protobuf import (
    descriptor_pb2,
    descriptor_pool,
    message_factory,
    wrappers_pb2,
)

PACKAGE = "csi.v1"
F = descriptor_pb2.FieldDescriptorProto
STRING, BOOL, INT64, ENUM, MESSAGE = (
    F.TYPE_STRING,
    F.TYPE_BOOL,
    F.TYPE_INT64,
    F.TYPE_ENUM,
    F.TYPE_MESSAGE,
)
OPTIONAL, REPEATED = F.LABEL_OPTIONAL, F.LABEL_REPEATED

# (name, number, type, label, type name for messages and enums, oneof index)
Field = tuple[str, int, int, int, str, int | None]


def _field(
    name: str,
    number: int,
    kind: int = STRING,
    label: int = OPTIONAL,
    type_name: str = "",
    oneof: int | None = None,
) -> Field:
    return (name, number, kind, label, type_name, oneof)


def _map(name: str, number: int, entry: str) -> Field:
    return _field(name, number, MESSAGE, REPEATED, entry)


# message name -> (fields, nested map entries, oneofs)
_MESSAGES: dict[str, tuple[list[Field], list[str], list[str]]] = {
    "GetPluginInfoRequest": ([], [], []),
    "GetPluginInfoResponse": (
        [_field("name", 1), _field("vendor_version", 2), _map("manifest", 3, "ManifestEntry")],
        ["ManifestEntry"],
        [],
    ),
    "GetPluginCapabilitiesRequest": ([], [], []),
    "GetPluginCapabilitiesResponse": (
        [_field("capabilities", 1, MESSAGE, REPEATED, ".csi.v1.PluginCapability")],
        [],
        [],
    ),
    "PluginCapability": (
        [_field("service", 1, MESSAGE, type_name=".csi.v1.PluginCapability.Service", oneof=0)],
        [],
        ["type"],
    ),
    "ProbeRequest": ([], [], []),
    "ProbeResponse": (
        [_field("ready", 1, MESSAGE, type_name=".google.protobuf.BoolValue")],
        [],
        [],
    ),
    "NodePublishVolumeRequest": (
        [
            _field("volume_id", 1),
            _map("publish_context", 2, "PublishContextEntry"),
            _field("staging_target_path", 3),
            _field("target_path", 4),
            _field("volume_capability", 5, MESSAGE, type_name=".csi.v1.VolumeCapability"),
            _field("readonly", 6, BOOL),
            _map("secrets", 7, "SecretsEntry"),
            _map("volume_context", 8, "VolumeContextEntry"),
        ],
        ["PublishContextEntry", "SecretsEntry", "VolumeContextEntry"],
        [],
    ),
    "NodePublishVolumeResponse": ([], [], []),
    "NodeUnpublishVolumeRequest": ([_field("volume_id", 1), _field("target_path", 2)], [], []),
    "NodeUnpublishVolumeResponse": ([], [], []),
    "NodeGetCapabilitiesRequest": ([], [], []),
    "NodeGetCapabilitiesResponse": (
        [_field("capabilities", 1, MESSAGE, REPEATED, ".csi.v1.NodeServiceCapability")],
        [],
        [],
    ),
    "NodeServiceCapability": (
        [_field("rpc", 1, MESSAGE, type_name=".csi.v1.NodeServiceCapability.RPC", oneof=0)],
        [],
        ["type"],
    ),
    "NodeGetInfoRequest": ([], [], []),
    "NodeGetInfoResponse": (
        [
            _field("node_id", 1),
            _field("max_volumes_per_node", 2, INT64),
            _field("accessible_topology", 3, MESSAGE, type_name=".csi.v1.Topology"),
        ],
        [],
        [],
    ),
    "Topology": ([_map("segments", 1, "SegmentsEntry")], ["SegmentsEntry"], []),
    "VolumeCapability": (
        [
            _field("block", 1, MESSAGE, type_name=".csi.v1.VolumeCapability.BlockVolume", oneof=0),
            _field("mount", 2, MESSAGE, type_name=".csi.v1.VolumeCapability.MountVolume", oneof=0),
            _field("access_mode", 3, MESSAGE, type_name=".csi.v1.VolumeCapability.AccessMode"),
        ],
        [],
        ["access_type"],
    ),
}
# Nested messages: (parent, name) -> fields; nested enums: (parent, name) -> values.
_NESTED: dict[tuple[str, str], list[Field]] = {
    ("PluginCapability", "Service"): [
        _field("type", 1, ENUM, type_name=".csi.v1.PluginCapability.Service.Type")
    ],
    ("NodeServiceCapability", "RPC"): [
        _field("type", 1, ENUM, type_name=".csi.v1.NodeServiceCapability.RPC.Type")
    ],
    ("VolumeCapability", "BlockVolume"): [],
    ("VolumeCapability", "MountVolume"): [
        _field("fs_type", 1),
        _field("mount_flags", 2, STRING, REPEATED),
        _field("volume_mount_group", 3),
    ],
    ("VolumeCapability", "AccessMode"): [
        _field("mode", 1, ENUM, type_name=".csi.v1.VolumeCapability.AccessMode.Mode")
    ],
}
_ENUMS: dict[tuple[str, str, str], list[tuple[str, int]]] = {
    ("PluginCapability", "Service", "Type"): [
        ("UNKNOWN", 0),
        ("CONTROLLER_SERVICE", 1),
        ("VOLUME_ACCESSIBILITY_CONSTRAINTS", 2),
        ("GROUP_CONTROLLER_SERVICE", 3),
    ],
    ("NodeServiceCapability", "RPC", "Type"): [
        ("UNKNOWN", 0),
        ("STAGE_UNSTAGE_VOLUME", 1),
        ("GET_VOLUME_STATS", 2),
        ("EXPAND_VOLUME", 3),
        ("VOLUME_CONDITION", 4),
        ("SINGLE_NODE_MULTI_WRITER", 5),
        ("VOLUME_MOUNT_GROUP", 6),
    ],
    ("VolumeCapability", "AccessMode", "Mode"): [
        ("UNKNOWN", 0),
        ("SINGLE_NODE_WRITER", 1),
        ("SINGLE_NODE_READER_ONLY", 2),
        ("MULTI_NODE_READER_ONLY", 3),
        ("MULTI_NODE_SINGLE_WRITER", 4),
        ("MULTI_NODE_MULTI_WRITER", 5),
        ("SINGLE_NODE_SINGLE_WRITER", 6),
        ("SINGLE_NODE_MULTI_WRITER", 7),
    ],
}
# service -> [(method, request, response)]
SERVICES: dict[str, list[tuple[str, str, str]]] = {
    "Identity": [
        ("GetPluginInfo", "GetPluginInfoRequest", "GetPluginInfoResponse"),
        ("GetPluginCapabilities", "GetPluginCapabilitiesRequest", "GetPluginCapabilitiesResponse"),
        ("Probe", "ProbeRequest", "ProbeResponse"),
    ],
    "Node": [
        ("NodePublishVolume", "NodePublishVolumeRequest", "NodePublishVolumeResponse"),
        ("NodeUnpublishVolume", "NodeUnpublishVolumeRequest", "NodeUnpublishVolumeResponse"),
        ("NodeGetCapabilities", "NodeGetCapabilitiesRequest", "NodeGetCapabilitiesResponse"),
        ("NodeGetInfo", "NodeGetInfoRequest", "NodeGetInfoResponse"),
    ],
}


def _add_fields(message: descriptor_pb2.DescriptorProto, fields: list[Field]) -> None:
    for name, number, kind, label, type_name, oneof in fields:
        field = message.field.add(name=name, number=number, type=kind, label=label)
        if type_name:
            field.type_name = type_name
        if oneof is not None:
            field.oneof_index = oneof


def _map_entry(message: descriptor_pb2.DescriptorProto, name: str) -> None:
    entry = message.nested_type.add(name=name)
    entry.options.map_entry = True
    _add_fields(entry, [_field("key", 1), _field("value", 2)])


def _file() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto(
        name="kvtier/csi/csi.proto", package=PACKAGE, syntax="proto3"
    )
    proto.dependency.append("google/protobuf/wrappers.proto")
    for name, (fields, entries, oneofs) in _MESSAGES.items():
        message = proto.message_type.add(name=name)
        for oneof in oneofs:
            message.oneof_decl.add(name=oneof)
        for entry in entries:
            _map_entry(message, entry)
        for field in fields:
            name_, number, kind, label, type_name, oneof_index = field
            if kind == MESSAGE and label == REPEATED and type_name in entries:
                field = (name_, number, kind, label, f".{PACKAGE}.{name}.{type_name}", oneof_index)
            _add_fields(message, [field])
    by_name = {m.name: m for m in proto.message_type}
    for (parent, name), fields in _NESTED.items():
        nested = by_name[parent].nested_type.add(name=name)
        _add_fields(nested, fields)
    for (parent, nested_name, name), values in _ENUMS.items():
        (nested,) = [n for n in by_name[parent].nested_type if n.name == nested_name]
        enum = nested.enum_type.add(name=name)
        for value_name, number in values:
            enum.value.add(name=value_name, number=number)
    for service, methods in SERVICES.items():
        declared = proto.service.add(name=service)
        for method, request, response in methods:
            declared.method.add(
                name=method,
                input_type=f".{PACKAGE}.{request}",
                output_type=f".{PACKAGE}.{response}",
            )
    return proto


_POOL = descriptor_pool.DescriptorPool()
_POOL.AddSerializedFile(wrappers_pb2.DESCRIPTOR.serialized_pb)
FILE = _POOL.Add(_file())


def message(name: str) -> Any:
    """The generated class of a CSI message, e.g. message("NodePublishVolumeRequest")."""
    return message_factory.GetMessageClass(FILE.message_types_by_name[name])
