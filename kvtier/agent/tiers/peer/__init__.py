"""The peer tier: chunks held in other nodes' pools, found through a directory spread over the
live agents and read over NIXL or ZMQ, every channel authenticated with the tier's CURVE keys."""
