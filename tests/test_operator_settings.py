"""The operator's settings from the environment the Helm chart sets: each field from
`KVTIER_<FIELD>`, lists comma-separated, and a bad value refused by its variable's name."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvtier.operator.settings import OperatorSettings


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OperatorSettings.model_fields:
        monkeypatch.delenv(f"KVTIER_{name.upper()}", raising=False)


def test_without_variables_the_defaults_hold() -> None:
    settings = OperatorSettings()
    assert settings == OperatorSettings.model_validate({})
    assert settings.image == "ghcr.io/kvtier/kvtier:0.1.0" and settings.webhook_port == 9443
    assert settings.allowed_registries == ["ghcr.io/kvtier/"] and settings.allowed_nfs_servers == []
    assert settings.peering is None


def test_every_variable_the_chart_sets_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    chart = {
        "KVTIER_IMAGE": "registry.local/kvtier:1.2.3",
        "KVTIER_RECONCILE_INTERVAL_SECONDS": "15",
        "KVTIER_STATUS_INTERVAL_SECONDS": "2.5",
        "KVTIER_HEARTBEAT_TIMEOUT_SECONDS": "90",
        "KVTIER_WEBHOOK_PORT": "8443",
        "KVTIER_ALLOWED_REGISTRIES": "registry.local/, ghcr.io/kvtier/,",
        "KVTIER_ALLOWED_NFS_SERVERS": "",
        "KVTIER_AGENT_UID": "1000",
        "KVTIER_WEBHOOK_CERT": "/etc/kvtier/webhook/tls.crt",
        "KVTIER_WEBHOOK_KEY": "/etc/kvtier/webhook/tls.key",
        "KVTIER_PEERING": "kvtier",
        "KVTIER_UPDATE_GOLDEN": "1",  # another KVTIER_ variable: not a setting, ignored
    }
    for name, value in chart.items():
        monkeypatch.setenv(name, value)
    settings = OperatorSettings()
    assert settings.image == "registry.local/kvtier:1.2.3"
    assert settings.reconcile_interval_seconds == 15.0
    assert settings.status_interval_seconds == 2.5
    assert settings.heartbeat_timeout_seconds == 90.0
    assert settings.webhook_port == 8443
    assert settings.allowed_registries == ["registry.local/", "ghcr.io/kvtier/"]
    assert settings.allowed_nfs_servers == []
    assert settings.agent_uid == 1000
    assert settings.webhook_cert == "/etc/kvtier/webhook/tls.crt"
    assert settings.webhook_key == "/etc/kvtier/webhook/tls.key"
    assert settings.peering == "kvtier"


def test_keywords_take_precedence_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_IMAGE", "registry.local/kvtier:env")
    monkeypatch.setenv("KVTIER_ALLOWED_NFS_SERVERS", "nfs-a,nfs-b")
    settings = OperatorSettings(image="registry.local/kvtier:test")
    assert settings.image == "registry.local/kvtier:test"
    assert settings.allowed_nfs_servers == ["nfs-a", "nfs-b"]
    assert OperatorSettings(allowed_nfs_servers=["nfs-c"]).allowed_nfs_servers == ["nfs-c"]


def test_only_the_upper_case_names_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("kvtier_image", "registry.local/kvtier:lower")
    assert OperatorSettings().image == "ghcr.io/kvtier/kvtier:0.1.0"


@pytest.mark.parametrize(("name", "value"), [("image", "evil.example/x:1"), ("agent_uid", "0")])
def test_a_field_s_bare_name_in_the_environment_is_not_read(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    """The constructor takes field names; the environment counts only KVTIER_* variables
    (a container's IMAGE or agent_uid never becomes the agents' image or uid)."""
    monkeypatch.setenv(name, value)
    monkeypatch.setenv(name.upper(), value)
    assert OperatorSettings() == OperatorSettings.model_construct()


@pytest.mark.parametrize(
    ("variable", "value", "problem"),
    [
        ("KVTIER_WEBHOOK_PORT", "70000", "less than or equal to 65535"),
        ("KVTIER_RECONCILE_INTERVAL_SECONDS", "soon", "valid number"),
        ("KVTIER_STATUS_INTERVAL_SECONDS", "0", "greater than 0"),
        ("KVTIER_AGENT_UID", "nobody", "valid integer"),
    ],
)
def test_a_bad_value_is_refused_by_its_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, problem: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as info:
        OperatorSettings()
    (error,) = info.value.errors()
    assert error["loc"] == (variable,) and error["input"] == value
    assert variable in str(info.value) and problem in str(info.value)
