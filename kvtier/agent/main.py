"""The agent's entry point: `kvtier agent` and `python -m kvtier.agent` (its container's
command) both come here, so the agent starts without the rest of the `kvtier` command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def start(config_path: Path, check: bool) -> int:
    """Run the agent (or with `check`, validate its config and runtime and print it)."""
    from kvtier.agent.logs import setup_logging
    from kvtier.agent.runtime_checks import check_runtime
    from kvtier.api.config import ConfigError, load_config

    # The tier's group is the boundary: what the agent creates in the tier's directory (its
    # socket, pool and lock files) is for the group, and for nobody else.
    os.umask(0o007)

    try:
        config = load_config(config_path)
        if check:
            check_runtime(config, create=False)
            print(config.to_yaml(), end="")
            return 0
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    setup_logging(config.log_level)
    from kvtier.agent.server import AlreadyServed, run_agent

    try:
        run_agent(config)
    except (ConfigError, AlreadyServed) as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.agent")
    parser.add_argument("--config", type=Path, required=True, help="the agent's YAML config")
    parser.add_argument("--check", action="store_true", help="validate, print and exit")
    args = parser.parse_args(argv)
    return start(args.config, args.check)
