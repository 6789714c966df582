"""The operator's settings, typed and read from the environment (set by the Helm chart)."""

from __future__ import annotations

import os

from pydantic import BaseModel, Field


class OperatorSettings(BaseModel):
    image: str = Field(default="ghcr.io/kvtier/kvtier:0.1.0", description="Agent image.")
    reconcile_interval_seconds: float = Field(default=30.0, gt=0)
    status_interval_seconds: float = Field(default=10.0, gt=0)
    heartbeat_timeout_seconds: float = Field(default=60.0, gt=0)
    tier_mount: str = Field(
        default="/var/run/kvtier",
        description="Where the tier's CSI volume (pool and agent socket) appears in pods.",
    )
    allowed_registries: list[str] = Field(
        default=["ghcr.io/kvtier/"],
        description="Image prefixes spec.agent.image may use (KVTIER_ALLOWED_REGISTRIES, "
        "comma-separated).",
    )
    allowed_nfs_servers: list[str] = Field(
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
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorSettings:
        """KVTIER_IMAGE, KVTIER_RECONCILE_INTERVAL_SECONDS, ... override the defaults."""
        env = dict(os.environ if env is None else env)
        values: dict[str, object] = {
            name: env[f"KVTIER_{name.upper()}"]
            for name in cls.model_fields
            if f"KVTIER_{name.upper()}" in env
        }
        for name in ("allowed_registries", "allowed_nfs_servers"):
            if isinstance(text := values.get(name), str):
                values[name] = [item.strip() for item in text.split(",") if item.strip()]
        return cls.model_validate(values)
