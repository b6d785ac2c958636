"""``infinity stress``: the memory-pressure stress test (see scenarios.py and docs/cli.md)."""
