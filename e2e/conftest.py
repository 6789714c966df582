"""The e2e scenarios reuse the fast suite's fixtures (scratch space, agent processes)."""

from tests.conftest import (  # noqa: F401
    agent_factory,
    make_config,
    pytest_runtest_makereport,
    scratch,
)
