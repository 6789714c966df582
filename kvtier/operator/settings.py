"""The operator's settings, typed and read from the environment (set by the Helm chart).

Each field is read from `KVTIER_<FIELD>` (KVTIER_IMAGE, KVTIER_RECONCILE_INTERVAL_SECONDS,
...), lists as comma-separated text; a value refused names its variable. Keywords given to
the constructor take precedence over the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AliasGenerator, Field, field_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

PREFIX = "KVTIER_"


def _variable(field: str) -> str:
    return f"{PREFIX}{field.upper()}"


class _KvtierEnvironment(EnvSettingsSource):
    """The environment's `KVTIER_*` variables only: a field's bare name (`image`,
    `agent_uid`), which the constructor accepts, is never read from the environment."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {k: v for k, v in super()._load_env_vars().items() if k.startswith(PREFIX)}


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(
        alias_generator=AliasGenerator(validation_alias=_variable),
        populate_by_name=True,
        case_sensitive=True,
    )

    image: str = Field(default="ghcr.io/kvtier/kvtier:0.1.0", description="Agent image.")
    reconcile_interval_seconds: float = Field(default=30.0, gt=0)
    status_interval_seconds: float = Field(default=10.0, gt=0)
    heartbeat_timeout_seconds: float = Field(default=60.0, gt=0)
    tier_mount: str = Field(
        default="/var/run/kvtier",
        description="Where the tier's CSI volume (pool and agent socket) appears in pods.",
    )
    allowed_registries: Annotated[list[str], NoDecode] = Field(
        default=["ghcr.io/kvtier/"],
        description="Image prefixes spec.agent.image may use (KVTIER_ALLOWED_REGISTRIES, "
        "comma-separated).",
    )
    allowed_nfs_servers: Annotated[list[str], NoDecode] = Field(
        default=[],
        description="NFS servers a filesystem tier may name (KVTIER_ALLOWED_NFS_SERVERS, "
        "comma-separated); none by default.",
    )
    plugin_dir: str = Field(default="/opt/kvtier/plugin", description="Plug-in code in the image.")
    agent_uid: int = 65532
    webhook_port: int = Field(default=9443, ge=1, le=65535)
    webhook_cert: str | None = Field(default=None, description="TLS certificate (PEM) path.")
    webhook_key: str | None = Field(default=None, description="TLS private key (PEM) path.")
    peering: str | None = Field(default=None, description="kopf peering name (replicas > 1).")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, _KvtierEnvironment(settings_cls, case_sensitive=True)

    @field_validator("allowed_registries", "allowed_nfs_servers", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """`a, b,` from the environment is ["a", "b"]; a list is taken as it is."""
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value
