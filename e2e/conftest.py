"""The e2e scenarios reuse the fast suite's fixtures (scratch space, agent processes)."""

from tests.conftest import agent_factory, make_config, scratch  # noqa: F401
