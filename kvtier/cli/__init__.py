"""The `kvtier` and `kubectl kvtier` commands: they parse flags and hand over to the part that
does the work, run in a user's shell or CI."""
