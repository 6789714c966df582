"""`kvtier demo`: an agent, client processes replaying chats, a second node and two vLLM
engines, on one machine. Nothing imports it but the CLI."""
