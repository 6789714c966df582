"""The plug-in payload's one definition (tools/plugin_payload.py), loaded by path for the tests
that check imports against it, import it where vLLM runs, or lay it out as the image does."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def payload_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "plugin_payload", REPO / "tools/plugin_payload.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
