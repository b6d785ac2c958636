"""`model.state_dict()` of a managed model gives the true values (issue 23):
offloaded parameters were NaN stand-ins, silently; torch.save of it into a
plain model then trained from NaN."""

import pytest
import torch
from paging_zoo import base_config, chain_data, small_chain

import infinity


model, data = small_chain, chain_data


@pytest.mark.parametrize("params,opt,dtype", [("host", "host", "fp32"), ("nvme", "nvme", "fp32"),
                                              ("none", "host", "fp32"), ("nvme", "nvme", "bf16")])
def test_state_dict_is_the_true_values_after_training(tmp_path, params, opt, dtype):
    cfg = infinity.Config(**base_config(offload_params=params, offload_optimizer=opt, dtype=dtype,
                                        device_memory=1 << 20, swap_paths=[str(tmp_path)], swap_block_size=4096))
    m, o = infinity.initialize(model(), cfg, lr=1e-2)
    for x, y in data(3):
        m(x.to(o.engine.modes.dtype), y.to(o.engine.modes.dtype)).backward()
        o.step()
        o.zero_grad()
    sd = m.state_dict()
    full = infinity.full_state_dict(m)
    assert sorted(sd) == sorted(full)
    for k, v in sd.items():
        assert not torch.isnan(v).any(), k
        assert v.dtype == o.engine.modes.dtype or not v.is_floating_point(), (k, v.dtype)
        assert torch.equal(v.float(), full[k].to(v.dtype).float()), k  # the compute copy: the master rounded
    block = m.blocks[1].state_dict()  # a submodule's own call
    assert torch.equal(block["a.weight"], sd["blocks.1.a.weight"])
    # Saved with torch and loaded into a plain model: the same outputs.
    torch.save(sd, tmp_path / "sd.pt")
    plain = model().to(o.engine.modes.dtype)
    plain.load_state_dict(torch.load(tmp_path / "sd.pt"))
    x, y = data(1, seed=9)[0]
    x, y = x.to(o.engine.modes.dtype), y.to(o.engine.modes.dtype)
    with torch.no_grad():
        assert torch.equal(plain(x, y), m(x, y))
    infinity.close(m)


def test_state_dict_refuses_a_model_larger_than_ram(tmp_path, monkeypatch):
    from infinity.engine.model import state_dict as sdmod
    cfg = infinity.Config(**base_config(offload_params="nvme", offload_optimizer="nvme", device_memory=1 << 20,
                                        swap_paths=[str(tmp_path)]))
    m, o = infinity.initialize(model(), cfg, lr=1e-2)
    monkeypatch.setattr(sdmod.sysinfo, "available_ram", lambda: 1000)
    with pytest.raises(infinity.engine.faults.UsageError, match="export_pretrained"):
        m.state_dict()
    assert infinity.full_state_dict(m)  # the engine is fine
    infinity.close(m)


def test_torch_clip_grad_norm_on_managed_parameters_raises_naming_max_grad_norm(tmp_path):
    """torch's clip_grad_norm_ saw p.grad None on every managed parameter:
    it returned 0 and clipped nothing, silently."""
    cfg = infinity.Config(**base_config(offload_params="host", offload_optimizer="host", device_memory=1 << 20))
    m, o = infinity.initialize(model(), cfg, lr=1e-2)
    x, y = data(1)[0]
    m(x, y).backward()
    for fn in (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_):
        with pytest.raises(infinity.engine.faults.UsageError, match="max_grad_norm"):
            fn(m.parameters(), 1.0)
    with pytest.raises(infinity.engine.faults.UsageError, match="max_grad_norm"):
        torch.nn.utils.clip_grad_value_(list(m.parameters())[:1], 0.1)
    o.step()  # nothing was changed: training goes on
    o.zero_grad()
    plain = torch.nn.Linear(3, 3)
    plain(torch.ones(2, 3)).sum().backward()
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in plain.parameters()]))
    assert torch.isclose(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9), want)  # others: torch's own
    infinity.close(m)


def test_a_step_skipped_for_a_nan_gradient_is_counted_and_logged(tmp_path, caplog):
    """With clipping, a NaN gradient norm skips the step (nothing changes);
    it was neither counted nor logged."""
    cfg = infinity.Config(**base_config(offload_params="host", offload_optimizer="host", device_memory=1 << 20,
                                        max_grad_norm=1.0))
    m, o = infinity.initialize(model(), cfg, lr=1e-2)
    before = infinity.full_state_dict(m)
    x, y = data(1)[0]
    x[0, 0] = float("nan")
    with caplog.at_level("WARNING", logger="infinity"):
        m(x, y).backward()
        o.step()
    o.zero_grad()
    assert infinity.stats(m)["skipped_steps"] == 1
    assert any("step skipped" in r.getMessage() and "nan" in r.getMessage() for r in caplog.records)
    after = infinity.full_state_dict(m)
    assert all(torch.equal(before[k], after[k]) for k in before)
    infinity.close(m)


def test_unit_classes_that_match_no_module_are_refused():
    """A misspelt unit class left the whole model in the root unit (nothing
    offloaded), silently."""
    cfg = infinity.Config(**base_config(offload_params="host", offload_optimizer="host", device_memory=1 << 20,
                                        unit_classes=["NoSuchClass"]))
    with pytest.raises(ValueError, match=r"unit_classes: \['NoSuchClass'\] match no module.*Linear"):
        infinity.initialize(model(), cfg, lr=1e-2)
