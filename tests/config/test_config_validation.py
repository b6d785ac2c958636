"""Config refuses every bad field value naming the field (issue 34, item 1):
NaN and infinities wherever a float is taken, sizes that overflow, wrong
container types, and numbers past what the native library can hold."""

import math

import numpy as np
import pytest

from infinity import Config
from infinity.config.validate import parse_bytes

NAN, INF = float("nan"), float("inf")

CASES = [
    (dict(dtype="fp16", initial_loss_scale=NAN), ValueError, r"Config\.initial_loss_scale=nan: must be a finite"),
    (dict(dtype="fp16", initial_loss_scale=INF), ValueError, r"Config\.initial_loss_scale=inf: must be a finite"),
    (dict(min_loss_scale=NAN), ValueError, r"Config\.min_loss_scale=nan"),
    (dict(loss_scale=INF), ValueError, r"Config\.loss_scale=inf"),
    (dict(loss_scale=NAN), ValueError, r"Config\.loss_scale=nan"),
    (dict(max_grad_norm=NAN), ValueError, r"Config\.max_grad_norm=nan"),
    (dict(max_grad_norm=INF), ValueError, r"Config\.max_grad_norm=inf"),
    (dict(max_grad_norm="1.0"), TypeError, r"Config\.max_grad_norm='1.0': must be a number"),
    (dict(initial_loss_scale=True), TypeError, r"Config\.initial_loss_scale=True"),
    (dict(min_loss_scale=4.0, initial_loss_scale=2.0), ValueError, r"min_loss_scale=4.0 is above initial_loss_scale"),
    (dict(host_memory=INF), ValueError, r"Config\.host_memory=inf: not a size"),
    (dict(device_memory="1e400"), ValueError, r"Config\.device_memory='1e400': .*above the largest"),
    (dict(prefetch_bytes=10**30), ValueError, r"Config\.prefetch_bytes=.*above the largest"),
    (dict(host_memory=NAN), ValueError, r"Config\.host_memory=nan"),
    (dict(host_memory=4096.5), ValueError, r"Config\.host_memory=4096.5: not a whole number of bytes"),
    (dict(host_memory=[1]), TypeError, r"Config\.host_memory=\[1\]: expected bytes"),
    (dict(swap_paths=5), TypeError, r"Config\.swap_paths=5: expected a list of directory paths"),
    (dict(swap_paths=[""]), ValueError, r"Config\.swap_paths\[0\]=''"),
    (dict(swap_paths=["/a", 3]), TypeError, r"Config\.swap_paths\[1\]=3"),
    (dict(swap_paths={"a": 1}), TypeError, r"Config\.swap_paths="),
    (dict(swap_block_size="1TiB"), ValueError, r"Config\.swap_block_size='1TiB': .*above the largest"),
    (dict(swap_block_size=INF), ValueError, r"Config\.swap_block_size=inf"),
    (dict(swap_queue_depth=2**64 + 1), ValueError, r"Config\.swap_queue_depth=18446744073709551617: .*\[1, 1024\]"),
    (dict(swap_queue_depth=1025), ValueError, r"Config\.swap_queue_depth=1025"),
    (dict(swap_queue_depth=16.0), TypeError, r"Config\.swap_queue_depth=16.0"),
    (dict(swap_queue_depth="16"), TypeError, r"Config\.swap_queue_depth='16'"),
    (dict(prefetch_depth=2**40), ValueError, r"Config\.prefetch_depth="),
    (dict(prefetch_depth=True), TypeError, r"Config\.prefetch_depth=True"),
    (dict(grad_accumulation_steps=2**31), ValueError, r"Config\.grad_accumulation_steps="),
    (dict(loss_scale_growth_interval=1.5), TypeError, r"Config\.loss_scale_growth_interval=1.5"),
    (dict(num_threads=2**32 + 1), ValueError, r"Config\.num_threads="),
    (dict(zero_stage=True), ValueError, r"Config\.zero_stage=True"),
    (dict(zero_stage=3.0), ValueError, r"Config\.zero_stage=3.0"),
    (dict(zero_stage=[3]), ValueError, r"Config\.zero_stage=\[3\]"),
    (dict(seed=2**64), ValueError, r"Config\.seed="),
    (dict(seed=1.0), TypeError, r"Config\.seed=1.0"),
    (dict(unit_classes=5), TypeError, r"Config\.unit_classes=5: expected a list"),
    (dict(unit_classes=[""]), ValueError, r"Config\.unit_classes: ''"),
    (dict(device="cuda:99999999999999999999"), ValueError, r"Config\.device="),
    (dict(device=None), TypeError, r"Config\.device=None"),
    (dict(dtype=None), ValueError, r"Config\.dtype=None: choose one of"),
]


@pytest.mark.parametrize("kw,exc,match", CASES, ids=[repr(c[0]) for c in CASES])
def test_bad_field_raises_naming_it(kw, exc, match):
    with pytest.raises(exc, match=match):
        Config(**kw)


def test_good_values_normalised():
    c = Config(swap_queue_depth=np.int64(32), prefetch_depth=np.int32(3), max_grad_norm=1,
               swap_paths=("/a", "/b"), swap_block_size="1GiB", host_memory=1e9, loss_scale=128,
               initial_loss_scale=2.0**40, seed=-1, unit_classes="Block")
    assert c.swap_queue_depth == 32 and type(c.swap_queue_depth) is int and type(c.prefetch_depth) is int
    assert c.max_grad_norm == 1.0 and isinstance(c.max_grad_norm, float)
    assert c.swap_paths == ["/a", "/b"] and c.swap_block_size == 1 << 30 and c.host_memory == 10**9
    assert c.loss_scale == 128.0 and c.unit_classes == ["Block"]
    assert Config(**c.to_dict()) == c


@pytest.mark.parametrize("text,want", [("1.1GB", 1_100_000_000), ("0.5KiB", 512), ("1e3", 1000),
                                       (" 2 MiB ", 2 << 20), (np.int64(7), 7), (0, 0)])
def test_parse_bytes_exact(text, want):
    assert parse_bytes(text, "x") == want


@pytest.mark.parametrize("text", ["1e400", "1e9999999GB", "1e-9999999KiB", "9" * 400, "1e-3", "0.3B", math.inf, -math.inf, math.nan, "nan", "inf", b"1"])
def test_parse_bytes_refuses(text):
    with pytest.raises((ValueError, TypeError), match=r"^x="):
        parse_bytes(text, "x")
