"""Values the input fuzzers draw from (tests/config/test_fuzz_config.py,
tests/cli/test_fuzz_runfile.py, tests/cli/test_fuzz_deepspeed.py): every JSON
type, the edges of each numeric range, NaN and the infinities, strings that
look like numbers and sizes, and containers of the wrong shape."""

import math

NASTY = [None, True, False, 0, -1, 1, 2, 3, 7, 16, 1024, 1025, 4096, 2**31, 2**63, 2**64 + 1, -2**70, 0.0, 0.5, 1.5,
         0.9, 1.0, 2.0, 1e-12, 1e30, 1e308, -0.1, math.nan, math.inf, -math.inf, "", "x", "auto", "3", "16",
         "1e400", "1e9999999GB", "1e-9999999KiB", "8GiB", "1TiB", "8G", "-1GB", "none", "cpu", "nvme", "host", "dynamic", "fp16", "bf16", "\x00",
         [], [1], [0.9, 0.95], [0.9, 1.0], ["a"], [math.nan, 0.9], {}, {"a": 1}, {"device": "cpu"}]


def finite(x) -> bool:
    """True for a finite int/float that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def near(value, rng):
    """A plausible neighbour of ``value`` (same type), so that mutations are accepted too."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return type(value)(value * rng.choice([0, 0.5, 1, 2, 3]))
    if isinstance(value, list):
        return [near(v, rng) for v in value]
    return value
