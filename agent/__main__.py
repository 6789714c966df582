"""`python -m kvtier.agent --config FILE`: the agent's entry point inside its container."""

import sys

from kvtier.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["agent", *sys.argv[1:]]))
