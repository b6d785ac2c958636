"""``infinity stress``: the memory-pressure stress test (see scenarios.py and docs/cli.md).

Owns: the scenarios, the soak's judgement, their worker process and the ballast
that squeezes RAM.
May import: checkpoint/, api.py, engine/ (the estimator, the pressure error)
and everything below, the package root included.
"""
