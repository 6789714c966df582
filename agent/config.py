"""The agent's typed configuration.

The operator renders this model into the agent's ConfigMap, so the field names follow the
CRD's camelCase. Every refusal names the field and the fix, because a platform engineer reads
it in `kubectl logs` of a crash-looping agent, far from the YAML that caused it.
"""

from __future__ import annotations

import os
import tempfile
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

from kvtier.agent.pool import SLOT_HEADER_BYTES, pool_slot_count, slot_payload_bytes
from kvtier.agent.units import format_bytes, parse_bytes

ByteSize = Annotated[int, BeforeValidator(parse_bytes)]

# Fixes for the errors pydantic words itself; our own validators put the fix in the message.
_FIXES = {
    "host.policy": "use one of: lru, arc",
    "host.capacity": "write a positive size such as 4Gi",
    "host.chunkBytes": "write the size of one vLLM offload row, such as 2Mi",
    "leaseTimeoutSeconds": "use a positive number of seconds, such as 30",
    "metrics.port": "use a port from 0 (any free port) to 65535",
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

    capacity: ByteSize = Field(description="Total bytes of the pool, headers included.")
    chunk_bytes: ByteSize = Field(description="Bytes of one KV chunk row, the slot payload size.")
    policy: Literal["lru", "arc"] = Field(default="lru", description="Eviction policy.")
    pool_dir: Path = Field(
        default=Path("/dev/shm/kvtier"), description="Directory of the pool file (a tmpfs)."
    )
    prefault: bool = Field(
        default=True, description="Touch every page at start so copies never page-fault."
    )

    @model_validator(mode="after")
    def _sizes(self) -> HostTierConfig:
        if self.capacity <= 0:
            raise ValueError(
                f"host.capacity must be positive (got {self.capacity}); "
                "fix: write a size such as 4Gi"
            )
        if self.chunk_bytes <= 0:
            raise ValueError(
                f"host.chunkBytes must be positive (got {self.chunk_bytes}); "
                "fix: write the size of one vLLM offload row, such as 2Mi"
            )
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


class MetricsConfig(_Model):
    enabled: bool = True
    host: str = "0.0.0.0"
    port: int = Field(default=9400, ge=0, le=65535)


class AgentConfig(_Model):
    """Everything one agent process needs; one agent serves one KVCacheTier on one node."""

    name: str = Field(
        default="default",
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        max_length=63,
        description="The KVCacheTier name; names the pool file and the socket directory.",
    )
    run_dir: Path = Field(
        default=Path("/run/kvtier/default"),
        description="Directory of the agent's control socket and client lock files.",
    )
    host: HostTierConfig
    lease_timeout_seconds: float = Field(default=30.0, gt=0)
    reap_interval_seconds: float = Field(default=1.0, gt=0)
    metrics: MetricsConfig = MetricsConfig()
    log_level: Literal["debug", "info", "warning", "error"] = "info"

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
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False)


def _field_path(loc: tuple[int | str, ...]) -> str:
    return ".".join(to_camel(p) if isinstance(p, str) else str(p) for p in loc)


def _describe(error: Any) -> str:
    path = _field_path(tuple(error["loc"]))
    message = str(error["msg"]).removeprefix("Value error, ")
    if "fix:" in message:
        return message
    if error["type"] == "extra_forbidden":
        return f"{path}: unknown field; fix: remove it or check its spelling"
    if error["type"] == "missing":
        return f"{path}: required field is missing; fix: add it"
    fix = _FIXES.get(path)
    got = f" (got {error['input']!r})" if "input" in error else ""
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
        raise ConfigError([f"config file {path} is not valid YAML: {exc}"]) from None
    return parse_config(data)


def _check_writable_dir(field: str, directory: Path) -> str | None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".kvtier-probe-"):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        return (
            f"{field}: {directory} is not a writable directory ({reason}); "
            f"fix: point {field} at a writable directory or mount one there"
        )
    return None


def check_runtime(config: AgentConfig) -> None:
    """Checks that need the filesystem, done once at start before anything is created."""
    problems = [
        p
        for p in (
            _check_writable_dir("host.poolDir", config.host.pool_dir),
            _check_writable_dir("runDir", config.run_dir),
        )
        if p
    ]
    if problems:
        raise ConfigError(problems)
