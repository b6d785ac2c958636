"""The optimizer's thread budget ([Note: the optimizer's thread budget], issue 36)."""

import torch

import infinity
from infinity.engine.plan.limits import RUNTIME_THREADS_CUDA, optimizer_threads
from infinity.system import native


def test_cuda_leaves_the_runtime_its_threads_and_the_config_or_environment_overrides():
    assert optimizer_threads(None, 16, is_cuda=True) == 16 - RUNTIME_THREADS_CUDA
    assert optimizer_threads(None, 2, is_cuda=True) == 1 and optimizer_threads(None, 1, is_cuda=True) == 1
    assert optimizer_threads(None, 16, is_cuda=False) == 16
    assert optimizer_threads(5, 16, is_cuda=True) == 5
    assert optimizer_threads(None, 16, is_cuda=True, env_set=True) == 16


def test_stats_show_the_threads_the_kernel_runs_with(monkeypatch):
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    m, o = infinity.initialize(m, infinity.Config(device="cpu", dtype="fp32"))
    assert infinity.stats(m)["optimizer_threads"] == native.default_num_threads()
    infinity.close(m)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    m, o = infinity.initialize(m, infinity.Config(device="cpu", dtype="fp32", num_threads=1))
    assert infinity.stats(m)["optimizer_threads"] == 1 and o.updater.num_threads == 1
    infinity.close(m)
