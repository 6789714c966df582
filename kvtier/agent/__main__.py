"""`python -m kvtier.agent --config FILE`: the agent's entry point inside its container."""

from kvtier.agent.main import main

if __name__ == "__main__":
    raise SystemExit(main())
