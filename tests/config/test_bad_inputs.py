"""Bad input across Config, initialize, the training loop and swap paths
(issue 21): each is answered by an exception whose message names the thing
at fault and the way out, and nothing saved is lost."""

import os
import subprocess

import pytest
import torch
from paging_zoo import Chain, base_config

import infinity
from infinity.config.runtime import parse_bytes
from infinity.engine.faults import UsageError

C = infinity.Config

CONFIG_CASES = [
    (dict(device_memory=-1), ValueError, r"device_memory=-1: must be >= 0 bytes"),
    (dict(device_memory="8G"), ValueError, r"8GB.*8GiB|8GiB.*8GB"),
    (dict(host_memory="abc"), ValueError, r"host_memory='abc': not a size"),
    (dict(host_memory="-1GB"), ValueError, r"host_memory"),
    (dict(offload_params="disk"), ValueError, r"offload_params='disk': choose one of \['none', 'host', 'nvme'\]"),
    (dict(offload_optimizer=3), ValueError, r"offload_optimizer=3: choose one of"),
    (dict(dtype="fp8"), ValueError, r"dtype='fp8': choose one of \['bf16', 'fp16', 'fp32'\]"),
    (dict(zero_stage=4), ValueError, r"zero_stage=4: choose 0, 1, 2 or 3"),
    (dict(prefetch_depth=-1), ValueError, r"prefetch_depth=-1: must be an int in \[0, 1024\]"),
    (dict(grad_accumulation_steps=0), ValueError, r"grad_accumulation_steps=0: must be an int in \[1, "),
    (dict(overlap="sometimes"), ValueError, r"overlap='sometimes': choose one of"),
    (dict(max_grad_norm=-1), ValueError, r"max_grad_norm=-1: must be in \(0, "),
    (dict(swap_paths="relative"), TypeError, r"swap_paths='relative': expected a list of directory paths"),
    (dict(swap_paths=[]), ValueError, r"swap_paths is empty"),
    (dict(swap_block_size=1000), ValueError, r"swap_block_size=1000: must be a positive multiple of 4096"),
    (dict(swap_queue_depth=0), ValueError, r"swap_queue_depth=0: must be an int \(requests in flight\) in \[1, 1024\]"),
    (dict(swap_backend="x"), ValueError, r"swap_backend='x': choose one of"),
    (dict(swap_checksum="yes"), TypeError, r"swap_checksum='yes': must be true or false"),
    (dict(loss_scale="dyn"), ValueError, r"loss_scale='dyn': 'dynamic' or a float > 0"),
    (dict(initial_loss_scale=0), ValueError, r"initial_loss_scale=0: must be in \(0, "),
    (dict(num_threads=0), ValueError, r"num_threads=0: must be an int \(or None: all cores\) in \[1, 4096\]"),
    (dict(device="tpu"), ValueError, r"device='tpu': choose 'auto', 'cuda', 'cuda:N' or 'cpu'"),
    (dict(device=3), TypeError, r"device=3"),
    (dict(prefetch_bytes=-5), ValueError, r"prefetch_bytes=-5: must be >= 0 bytes"),
    (dict(seed="a"), TypeError, r"seed='a': must be an int"),
    (dict(unit_classes=[3]), TypeError, r"unit_classes: 3 is neither a class nor a class name"),
    (dict(bogus=1), ValueError, r"unknown field\(s\) \['bogus'\]; valid fields are"),
]


@pytest.mark.parametrize("kw,exc,match", CONFIG_CASES, ids=[str(c[0]) for c in CONFIG_CASES])
def test_config_field_errors_name_the_field_and_the_valid_values(kw, exc, match):
    with pytest.raises(exc, match=match):
        C(**kw)


@pytest.mark.parametrize("text,want", [("8GB", 8 * 10**9), ("8GiB", 8 << 30), ("1e9", 10**9), (1e9, 10**9),
                                       ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), (4096, 4096)])
def test_byte_sizes_accepted(text, want):
    assert parse_bytes(text, "x") == want
    assert C(host_memory=text).host_memory == want


@pytest.mark.parametrize("text", ["8G", "8 XB", "-1GB", "GB", "1.5.2GB", True])
def test_byte_sizes_refused(text):
    with pytest.raises((ValueError, TypeError), match="host_memory"):
        C(host_memory=text)


def cfg(**kw):
    return C(**base_config(**dict(dict(offload_params="host", offload_optimizer="host", device_memory=1 << 20), **kw)))


def net():
    torch.manual_seed(0)
    return Chain([32, 16])


INIT_CASES = [
    ("lr", lambda: infinity.initialize(net(), cfg(), lr=-1), ValueError, r"Invalid lr: -1"),
    ("kwarg", lambda: infinity.initialize(net(), cfg(), momentum=0.9), ValueError,
     r"unknown optimizer argument\(s\) \['momentum'\]; valid:"),
    ("group key", lambda: infinity.initialize(net(), cfg(), param_groups=[{"params": [], "momentum": 0.9}]),
     ValueError, r"param_groups\[0\] has unknown key\(s\) \['momentum'\]"),
    ("config type", lambda: infinity.initialize(net(), {"device": "cpu"}), TypeError,
     r"config must be an infinity.Config, got dict"),
    ("model type", lambda: infinity.initialize("model", cfg()), TypeError, r"model must be an nn.Module, got str"),
    ("bf16 params", lambda: infinity.initialize(net().to(torch.bfloat16), cfg()), TypeError,
     r"parameter 'inp.weight' has dtype torch.bfloat16; give the model in float32"),
    ("unit classes", lambda: infinity.initialize(net(), cfg(unit_classes=["NoSuchBlock"])), ValueError,
     r"NoSuchBlock"),
    ("device budget", lambda: infinity.initialize(net(), cfg(device_memory=1000)), infinity.BudgetError,
     r"device_memory=1000 bytes .* is too small: it needs at least \d+ bytes"),
    ("host budget", lambda: infinity.initialize(net(), cfg(host_memory=1000)), infinity.BudgetError,
     r"host tier: .* needs \d+ bytes .* more than host_memory=1000 bytes"),
]


@pytest.mark.parametrize("name,call,exc,match", INIT_CASES, ids=[c[0] for c in INIT_CASES])
def test_initialize_errors_name_the_argument(name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_meta_parameters_without_infinity_init():
    with torch.device("meta"):
        m = Chain([32, 16])
    with pytest.raises(ValueError, match="meta device but was not built under `with infinity.init"):
        infinity.initialize(m, cfg())


def test_initialize_twice():
    m, o = infinity.initialize(net(), cfg())
    with pytest.raises(ValueError, match="already managed by infinity"):
        infinity.initialize(m, cfg())
    infinity.close(m)


def test_step_without_backward_changes_nothing_like_torch():
    m, o = infinity.initialize(net(), cfg(), lr=1e-2)
    before = infinity.full_state_dict(m)
    o.step()  # torch skips parameters whose grad is None
    after = infinity.full_state_dict(m)
    assert all(torch.equal(before[k], v) for k, v in after.items())
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    m(x, y).backward()  # no gradients were held: no zero_grad() needed
    o.step()
    infinity.close(m)


def nvme_cfg(path):
    return C(**base_config(offload_params="nvme", offload_optimizer="nvme", device_memory=1 << 20,
                           swap_paths=[str(path)]))


def test_swap_path_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("mine")
    with pytest.raises(OSError, match=r"'.*afile' is not a directory; remove it or choose another swap path"):
        infinity.initialize(net(), nvme_cfg(f))
    assert f.read_text() == "mine"


def test_swap_path_of_a_live_run_and_foreign_files(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    m, o = infinity.initialize(net(), nvme_cfg(tmp_path))
    with pytest.raises(Exception, match=r"is in use by another SwapStore \(pid \d+; lock file .*\)\. Give this run "
                                      r"its own directory"):
        infinity.initialize(net(), nvme_cfg(tmp_path))
    infinity.close(m)
    assert (tmp_path / "notes.txt").read_text() == "keep me"  # never ours to delete


def test_swap_path_on_a_read_only_filesystem(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode:
        pytest.skip("mounting a read-only tmpfs needs root")
    try:
        with pytest.raises(OSError, match=r"cannot create swap directory '.*ro/swap': the filesystem is read-only; "
                                          r"remount it read-write"):
            infinity.initialize(net(), nvme_cfg(mnt / "swap"))
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_non_finite_loss_skips_and_counts_the_step():
    m, o = infinity.initialize(net(), cfg(max_grad_norm=1.0), lr=1e-2)
    before = infinity.full_state_dict(m)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    (m(x, y) * float("inf")).backward()
    o.step()
    o.zero_grad()
    assert infinity.stats(m)["skipped_steps"] == 1
    assert all(torch.equal(before[k], v) for k, v in infinity.full_state_dict(m).items())
    infinity.close(m)


def test_use_after_close_raises():
    m, o = infinity.initialize(net(), cfg())
    infinity.close(m)
    with pytest.raises(UsageError, match="after infinity.close"):
        o.step()
    with pytest.raises(ValueError, match="not managed by infinity: call infinity.initialize"):
        infinity.stats(m)


def test_deepcopy_and_pickling_a_managed_model_name_the_way():
    import copy
    import io
    m, o = infinity.initialize(net(), cfg())
    for call in (lambda: copy.deepcopy(m), lambda: torch.save(m, io.BytesIO())):
        with pytest.raises(UsageError, match="infinity.save_checkpoint.*infinity.close"):
            call()
    infinity.close(m)
    copy.deepcopy(m)  # an ordinary model after close
