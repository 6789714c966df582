"""The agent's typed configuration.

The operator renders this model into the agent's ConfigMap, so the field names follow the
CRD's camelCase. Every refusal names the field and the fix, because a platform engineer reads
it in `kubectl logs` of a crash-looping agent, far from the YAML that caused it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic.alias_generators import to_camel

from kvtier.api.pool_layout import SLOT_HEADER_BYTES, pool_slot_count, slot_payload_bytes
from kvtier.api.units import format_bytes, parse_bytes

ByteSize = Annotated[int, BeforeValidator(parse_bytes)]

# Fixes for the errors pydantic words itself (a tier's fields under the tier's kind, whatever
# its position); our own validators put the fix in the message.
_FIXES = {
    "host.policy": "use one of: lru, arc, prefix",
    "host.capacity": "write a positive size such as 4Gi",
    "host.chunkBytes": "write the size of one vLLM offload row, such as 2Mi",
    "filesystem.capacity": "write a positive size such as 100Gi",
    "objectStore.capacity": "write a positive size such as 1Ti",
    "filesystem.highWatermark": "a share of the tier's capacity in (0, 1], such as 0.9",
    "filesystem.lowWatermark": "a share of the tier's capacity in (0, 1), such as 0.8",
    "leaseTimeoutSeconds": "use a positive number of seconds up to 3600, such as 30",
    "reapIntervalSeconds": "use a positive number of seconds up to 3600, such as 1",
    "tierBudgetSeconds": "use a positive number of seconds up to 3600, such as 2",
    "report.intervalSeconds": "use a positive number of seconds up to 3600, such as 10",
    "report.minIntervalSeconds": "use a positive number of seconds up to 3600, such as 2",
    "metrics.port": "use a port from 0 (any free port) to 65535",
    "name": "use the KVCacheTier's name: lowercase letters, digits and '-', at most 63",
}


class ConfigError(ValueError):
    """A configuration the agent refuses to start with; each line names a field and its fix."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid kvtier agent config:\n" + "\n".join(f"  - {p}" for p in problems))


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class HostTierConfig(_Model):
    """The node-wide shared-memory pool every engine on the node reads and writes."""

    capacity: ByteSize = Field(gt=0, description="Total bytes of the pool, headers included.")
    chunk_bytes: ByteSize = Field(
        gt=0, description="Bytes of one KV chunk row, the slot payload size."
    )
    policy: Literal["lru", "arc", "prefix"] = Field(default="lru", description="Eviction policy.")
    pool_dir: Path = Field(
        default=Path("/dev/shm/kvtier"), description="Directory of the pool file (a tmpfs)."
    )
    prefault: bool = Field(
        default=True, description="Touch every page at start so copies never page-fault."
    )

    @model_validator(mode="after")
    def _sizes(self) -> HostTierConfig:
        if self.slot_count < 1:
            slot = SLOT_HEADER_BYTES + slot_payload_bytes(self.chunk_bytes)
            raise ValueError(
                f"host.chunkBytes ({format_bytes(self.chunk_bytes)}, {format_bytes(slot)} per "
                f"slot with its header) does not fit in host.capacity "
                f"({format_bytes(self.capacity)}); fix: raise host.capacity or lower "
                "host.chunkBytes"
            )
        return self

    @property
    def slot_count(self) -> int:
        return pool_slot_count(self.capacity, self.chunk_bytes)


_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Bounds on periods and timeouts: past them a value is a mistake (`.inf` parses as a float),
# and the threads that sleep or poll that long would overflow their clocks' integers.
HOUR_SECONDS = 3600.0
DAY_SECONDS = 86400.0
SOCKET_PATH_MAX = 107  # sockaddr_un's sun_path, less its terminating NUL


class FilesystemTierConfig(_Model):
    """A directory, possibly shared between nodes (NFS, CephFS, Lustre, a PVC)."""

    path: Path = Field(description="Mounted directory that holds the tier's files.")
    capacity: ByteSize = Field(gt=0, description="Bytes this tier may hold.")
    high_watermark: float = Field(default=0.9, gt=0, le=1, description="Evict above this share.")
    low_watermark: float = Field(default=0.8, gt=0, lt=1, description="Evict down to this share.")
    fsync: bool = Field(default=True, description="fsync each file before publishing it.")
    direct_io: bool = Field(default=False, description="Read and write with O_DIRECT.")
    touch_interval_seconds: float = Field(
        default=60.0,
        ge=0,
        le=DAY_SECONDS,
        description="A read refreshes a file's access time if older than this.",
    )
    scan_interval_seconds: float = Field(
        default=30.0,
        gt=0,
        le=DAY_SECONDS,
        description="Rescan to count other agents' files and evict.",
    )

    @model_validator(mode="after")
    def _check(self) -> FilesystemTierConfig:
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f".lowWatermark ({self.low_watermark}) must be below highWatermark "
                f"({self.high_watermark}); fix: e.g. lowWatermark 0.8, highWatermark 0.9"
            )
        return self


class ObjectStoreTierConfig(_Model):
    """Any S3-compatible endpoint."""

    endpoint: str | None = Field(default=None, description="S3 endpoint URL; AWS when unset.")
    bucket: str = Field(min_length=3, max_length=63)
    prefix: str = Field(default="", description="Key prefix inside the bucket.")
    region: str = "us-east-1"
    capacity: ByteSize = Field(gt=0, description="Bytes this tier may hold.")
    credentials_dir: Path | None = Field(
        default=None,
        description="Directory with files accessKeyId and secretAccessKey (a mounted Secret); "
        "the environment's AWS credentials when unset.",
    )
    max_concurrency: int = Field(default=16, ge=1, le=256)
    timeout_seconds: float = Field(default=5.0, gt=0)
    retries: int = Field(default=3, ge=0, le=20)
    negative_cache_seconds: float = Field(
        default=2.0, ge=0, description="How long a key found absent is not asked for again."
    )


class PeerTierConfig(_Model):
    """Other nodes' agents: chunks they hold are fetched instead of recomputed."""

    bind: str = Field(default="tcp://0.0.0.0:5557", description="Where this agent serves peers.")
    advertise: str | None = Field(
        default=None,
        description="Endpoint peers are told to dial (a name or address that reaches `bind` "
        "from other nodes); default: the bound endpoint, with the pod's address or this host's "
        "name.",
    )
    curve_key_dir: Path | None = Field(
        default=None,
        description="Directory with the cluster's CURVE key pair (public.key, secret.key, Z85); "
        "peers without it are refused. Unset: no authentication.",
    )
    timeout_seconds: float = Field(default=1.0, gt=0)
    announce_ttl_seconds: float = Field(
        default=120.0, gt=0, description="How long a home remembers who holds a key."
    )
    membership_seconds: float = Field(
        default=10.0, gt=0, description="How often the list of live agents is re-read."
    )
    stale_floor_seconds: float = Field(
        default=30.0,
        gt=0,
        description="An agent is gone after three missed heartbeats, never sooner than this "
        "(heartbeats carry other nodes' clocks); lowered only in tests.",
    )
    idle_seconds: float = Field(
        default=60.0, gt=0, description="Connections to a peer unused this long are closed."
    )
    data_path: Literal["auto", "nixl", "tcp", "zmq"] = Field(
        default="auto",
        description="How chunk bytes move between agents: NIXL (UCX) reads straight between "
        "the pools; tcp: a TCP stream, each chunk authenticated (GMAC under a key sent over "
        "CURVE for the request); zmq: ZMQ frames. auto: NIXL where installed on both sides, "
        "else the stream; nixl: the same, refusing to start without NIXL. Each falls back "
        "to ZMQ frames.",
    )
    stream_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="TCP port of the stream (on the peer endpoint's address); default: any "
        "free port (the operator sets its dataPort, 5560 unless set).",
    )
    encrypt_bytes: bool = Field(
        default=False,
        description="Chunks this agent reads over the stream are encrypted as well "
        "(AES-GCM), for networks not trusted with the bytes, and NIXL, which moves them in "
        "the clear, is not used; off, they travel in the clear, each authenticated.",
    )
    max_lent_chunks: int = Field(
        default=256,
        ge=1,
        description="Chunks this agent serves to peers at once; more requests are refused "
        "(a miss for the asker) so an overloaded node sheds load instead of queueing it.",
    )

    @model_validator(mode="after")
    def _encrypted_path(self) -> PeerTierConfig:
        if self.encrypt_bytes and self.data_path == "nixl":
            raise ValueError(
                "encryptBytes with dataPath 'nixl': NIXL moves chunk bytes in the clear; "
                "set dataPath to 'auto' or 'tcp' (the encrypted stream), or drop encryptBytes"
            )
        return self


class TierConfig(_Model):
    """One secondary tier; exactly one backend key is set."""

    name: str = Field(pattern=_DNS_LABEL, max_length=63)
    filesystem: FilesystemTierConfig | None = None
    object_store: ObjectStoreTierConfig | None = None
    peer: PeerTierConfig | None = None
    queue_depth: int = Field(
        default=256, ge=1, description="Write-backs waiting for this tier; more are dropped."
    )
    workers: int = Field(default=2, ge=1, le=64, description="Threads writing to this tier.")
    admit_after_hits: int = Field(
        default=0, ge=0, description="Write a chunk here only once it was hit this many times."
    )

    @model_validator(mode="after")
    def _one_backend(self) -> TierConfig:
        backends = [b for b in (self.filesystem, self.object_store, self.peer) if b is not None]
        if len(backends) != 1:
            raise ValueError(
                f"tier {self.name!r} sets {len(backends)} backends; fix: give each tier "
                "exactly one of filesystem, objectStore or peer"
            )
        return self

    @property
    def kind(self) -> str:
        if self.filesystem is not None:
            return "filesystem"
        return "objectStore" if self.object_store is not None else "peer"


class ReportConfig(_Model):
    """Where the agent publishes its report (occupancy, hits, fingerprints, heartbeat)."""

    target: Literal["none", "kubernetes", "file"] = Field(
        default="none",
        description="kubernetes: its own KVCacheNode (in-cluster credentials, else the "
        "kubeconfig); file: a JSON file per node in `directory`.",
    )
    namespace: str | None = Field(default=None, description="Namespace of the KVCacheTier.")
    tier: str | None = Field(default=None, description="Name of the KVCacheTier.")
    node: str | None = Field(default=None, description="Node name; default $NODE_NAME.")
    directory: Path | None = None
    interval_seconds: float = Field(
        default=10.0, gt=0, le=HOUR_SECONDS, description="Heartbeat period."
    )
    min_interval_seconds: float = Field(
        default=2.0, gt=0, le=HOUR_SECONDS, description="Changes are published at most this often."
    )

    @model_validator(mode="after")
    def _target_fields(self) -> ReportConfig:
        if self.target == "kubernetes" and not (self.namespace and self.tier):
            raise ValueError(
                "report.target kubernetes needs report.namespace and report.tier; "
                "fix: set both (the operator does)"
            )
        if self.target == "file" and self.directory is None:
            raise ValueError("report.target file needs report.directory; fix: set it")
        return self


class AccessLogConfig(_Model):
    """The bounded log of hashed lookups that `kvtier trace` exports."""

    max_keys: int = Field(default=1 << 20, ge=1, le=1 << 24, description="Keys the log holds.")
    sample_rate: float = Field(
        default=1.0, ge=0.0001, le=1, description="Share of requests logged whole."
    )


class MetricsConfig(_Model):
    enabled: bool = True
    host: str = "0.0.0.0"
    port: int = Field(default=9400, ge=0, le=65535)


class EventStreamConfig(_Model):
    """The node's KV events on ZMQ for routers outside the engines, in vLLM's KV-event wire
    format (`--kv-events-config` publisher zmq): msgpack KVEventBatch messages
    (topic, sequence, payload) on a PUB socket and a ROUTER socket that replays from a
    sequence number."""

    enabled: bool = Field(default=False, description="Publish the stream (off by default).")
    bind: str = Field(default="tcp://0.0.0.0:5558", description="The PUB socket.")
    replay_bind: str = Field(default="tcp://0.0.0.0:5559", description="The replay ROUTER socket.")
    topic: str = Field(
        default="kv@{node}@{namespace}",
        max_length=253,
        description="Each batch's topic; {node} and {namespace} are filled in. A batch "
        "clearing the node (AllBlocksCleared) has an empty namespace.",
    )
    buffer_steps: int = Field(
        default=10000, ge=1, le=1 << 20, description="Batches kept for replay."
    )
    int_block_hashes: bool = Field(
        default=True,
        description="Block hashes as 64-bit integers (vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_"
        "HASHES default), else as bytes.",
    )
    curve_key_dir: Path | None = Field(
        default=None,
        description="CURVE key pair (public.key, secret.key, Z85; the peer tier's Secret): "
        "subscribers must dial with a trusted key pair and this public key. Unset: open.",
    )
    interval_seconds: float = Field(default=0.05, gt=0, le=10)

    @model_validator(mode="after")
    def _topic(self) -> EventStreamConfig:
        """The topic is filled in with str.format: another field in braces would fail
        every batch, so it is refused here."""
        try:
            self.topic.format(node="n", namespace="ns")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"events.topic {self.topic!r} names a field other than {{node}} and "
                f"{{namespace}} ({exc}); fix: use only those two, and {{{{ }}}} for a brace"
            ) from exc
        return self


class AgentConfig(_Model):
    """Everything one agent process needs; one agent serves one KVCacheTier on one node."""

    name: str = Field(
        default="default",
        pattern=_DNS_LABEL,
        max_length=63,
        description="The KVCacheTier name; names the pool file and the socket directory.",
    )
    run_dir: Path = Field(
        default=Path("/run/kvtier/default"),
        description="Directory of the agent's control socket and client lock files.",
    )
    host: HostTierConfig
    tiers: list[TierConfig] = Field(
        default_factory=list, description="Secondary tiers, asked in this order on a host miss."
    )
    lease_timeout_seconds: float = Field(default=30.0, gt=0, le=HOUR_SECONDS)
    tier_budget_seconds: float = Field(
        default=2.0,
        gt=0,
        le=HOUR_SECONDS,
        description="Longest a lookup or load waits on secondary tiers; keep it below the "
        "clients' timeout. What is not answered by then is a miss.",
    )
    reap_interval_seconds: float = Field(default=1.0, gt=0, le=HOUR_SECONDS)
    metrics: MetricsConfig = MetricsConfig()
    report: ReportConfig = ReportConfig()
    access_log: AccessLogConfig = AccessLogConfig()
    events: EventStreamConfig = EventStreamConfig()
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _peers_need_a_registry(self) -> AgentConfig:
        peers = [i for i, t in enumerate(self.tiers) if t.peer is not None]
        if len(peers) > 1:
            raise ValueError("tiers: at most one peer tier; fix: keep one peer entry")
        if peers and self.report.target == "none":
            raise ValueError(
                f"tiers[{peers[0]}].peer: agents find their peers through their reports; "
                "fix: set report.target to kubernetes or file"
            )
        return self

    @model_validator(mode="after")
    def _unique_tiers(self) -> AgentConfig:
        names = [t.name for t in self.tiers]
        for name in sorted({n for n in names if names.count(n) > 1 or n == "host"}):
            raise ValueError(
                f"tiers: name {name!r} is used twice or is reserved; fix: give each tier its "
                "own name other than host"
            )
        return self

    @model_validator(mode="after")
    def _socket_fits(self) -> AgentConfig:
        length = len(os.fsencode(self.socket_path))
        if length > SOCKET_PATH_MAX:
            raise ValueError(
                f"runDir: its socket path {self.socket_path} is {length} bytes, over the "
                f"{SOCKET_PATH_MAX} a unix socket's address holds; fix: a shorter runDir"
            )
        return self

    @property
    def socket_path(self) -> Path:
        return self.run_dir / "agent.sock"

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.socket_path}"

    @property
    def pool_path(self) -> Path:
        return self.host.pool_dir / f"{self.name}.pool"

    def to_yaml(self) -> str:
        return yaml.safe_dump(
            self.model_dump(mode="json", by_alias=True, exclude_none=True), sort_keys=False
        )


def _field_path(loc: tuple[int | str, ...]) -> str:
    return ".".join(to_camel(p) if isinstance(p, str) else str(p) for p in loc)


def _describe(error: Any) -> str:
    path = _field_path(tuple(error["loc"]))
    message = str(error["msg"]).removeprefix("Value error, ")
    if message.startswith("."):  # a nested model's own validator names a field of its own
        return f"{path}{message}"
    if "fix:" in message:
        return message
    if error["type"] == "extra_forbidden":
        return f"{path}: unknown field; fix: remove it or check its spelling"
    if error["type"] == "missing":
        return f"{path}: required field is missing; fix: add it"
    fix = _FIXES.get(path) or _FIXES.get(re.sub(r"^tiers\.\d+\.", "", path))
    # our own validators' messages (value errors) say what they got already
    got = (
        f" (got {error['input']!r})" if "input" in error and error["type"] != "value_error" else ""
    )
    if error["type"] == "greater_than" and error.get("ctx", {}).get("gt") == 0:
        return f"{path} must be positive{got}" + (f"; fix: {fix}" if fix else "")
    return f"{path}: {message}{got}" + (f"; fix: {fix}" if fix else "")


def parse_config(data: Any) -> AgentConfig:
    """Validate a mapping into an AgentConfig, turning pydantic's errors into ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(["the config must be a YAML mapping of fields to values"])
    try:
        return AgentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([_describe(e) for e in exc.errors()]) from None


def load_config(path: str | os.PathLike[str]) -> AgentConfig:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(
            [f"config file {path}: {exc.strerror}; fix: pass an existing file"]
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        said = " ".join(str(exc).split())  # one line: yaml's message spans several
        raise ConfigError([f"config file {path} is not valid YAML: {said}"]) from None
    return parse_config(data)
