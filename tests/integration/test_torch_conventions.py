"""A managed model answers ordinary torch calls made outside forward with the
true values, or raises naming the infinity way (issue 23). On 5147b56 each
of these read NaN stand-ins, lost the write, or differed from torch silently."""

import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn
from paging_zoo import base_config
from test_torch_state_dict import data, model  # one model and data for both files

import infinity
from infinity.engine.faults import UsageError


def managed(tmp_path, params="host", opt="host", **kw):
    cfg = infinity.Config(**base_config(offload_params=params, offload_optimizer=opt, device_memory=1 << 20,
                                        swap_paths=[str(tmp_path)], swap_block_size=4096, **kw))
    return infinity.initialize(model(), cfg, lr=1e-2)


def reference():
    ref = model()
    return ref, torch.optim.AdamW(ref.parameters(), lr=1e-2)


def train(m, o, batches):
    losses = []
    for x, y in batches:
        loss = m(x, y)
        loss.backward()
        o.step()
        o.zero_grad()
        losses.append(loss.item())
    return losses


PLACEMENTS = [("host", "host"), ("nvme", "nvme"), ("none", "host")]


@pytest.mark.parametrize("params,opt", PLACEMENTS)
def test_reading_a_parameter_outside_forward_gives_its_values(tmp_path, params, opt):
    m, o = managed(tmp_path, params, opt)
    ref, ro = reference()
    batches = data(2)
    train(m, o, batches), train(ref, ro, batches)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert isinstance(p, nn.Parameter) and p.shape == q.shape and p.requires_grad
        for got, want in ((p.detach(), q.detach()), (p.data, q.data), (p.sum(), q.sum()), (p[0], q[0]),
                          (p.detach().cpu().numpy(), q.detach().numpy())):
            got = torch.as_tensor(got)
            assert not torch.isnan(got).any(), name
            torch.testing.assert_close(got, torch.as_tensor(want), rtol=1e-5, atol=1e-6, msg=name)
    w = m.blocks[1].a.weight
    assert "nan" not in repr(w) and torch.equal(torch.stack([w, w]).sum(0), 2 * w.detach())
    buf = io.BytesIO()
    torch.save(w, buf)  # pickles the values, as an ordinary Parameter
    back = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert type(back) is nn.Parameter and torch.equal(back, w.detach())
    infinity.close(m)


@pytest.mark.parametrize("params,opt", PLACEMENTS)
def test_in_place_edits_between_steps_write_through_like_torch(tmp_path, params, opt):
    """``with torch.no_grad(): p.fill_(5)`` between steps was lost, silently."""
    m, o = managed(tmp_path, params, opt)
    ref, ro = reference()
    batches = data(4)
    assert train(m, o, batches[:2]) == pytest.approx(train(ref, ro, batches[:2]), rel=1e-6)
    for net in (m, ref):
        with torch.no_grad():
            net.blocks[1].a.bias.fill_(0.5)
            net.blocks[2].a.weight.data.mul_(0.5)
            net.out.weight[0] = 0.25
            nn.init.zeros_(net.blocks[0].b.bias)
            net.inp.bias += 1.0
    assert torch.equal(m.blocks[1].a.bias.detach(), ref.blocks[1].a.bias.detach())
    assert train(m, o, batches[2:]) == pytest.approx(train(ref, ro, batches[2:]), rel=1e-5)
    infinity.close(m)


def test_writes_to_a_copy_of_the_values_raise(tmp_path):
    m, o = managed(tmp_path)
    w = m.blocks[1].a.weight
    for alias in (w.detach(), w[0], w.view(-1), w.detach().t()):
        with pytest.raises(UsageError, match="would not reach the parameter"):
            alias.zero_()
    clone = w.detach().clone()
    clone.zero_()  # an ordinary tensor of its own
    assert w.abs().sum() > 0
    with pytest.raises(UsageError, match="no storage of its own"):
        w.data_ptr()
    with pytest.raises(UsageError, match="Config.dtype"):
        m.half()
    m.to("cpu")  # the device it is on: nothing changes
    assert m.blocks[1].a.weight.dtype == torch.float32
    infinity.close(m)


@pytest.mark.parametrize("params,opt", [("host", "host"), ("nvme", "nvme")])
def test_load_state_dict_after_initialize_writes_into_the_tiers(tmp_path, params, opt):
    """It raised 'more than one element of the written-to tensor refers to a single memory location'."""
    m, o = managed(tmp_path, params, opt)
    train(m, o, data(1))
    other = model()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-2.0)
    res = m.load_state_dict(other.state_dict())
    assert not res.missing_keys and not res.unexpected_keys
    full = infinity.full_state_dict(m)
    for k, v in other.state_dict().items():
        assert torch.equal(full[k], v), k
    x, y = data(1, seed=8)[0]
    with torch.no_grad():
        assert torch.equal(m(x, y), other(x, y))
    # strict=False reports what torch reports; a shape mismatch writes nothing.
    sd = other.state_dict()
    sd.pop("out.bias")
    sd["extra"] = torch.zeros(1)
    res = m.load_state_dict(sd, strict=False)
    assert res.missing_keys == ["out.bias"] and res.unexpected_keys == ["extra"]
    bad = {k: (v if k != "blocks.0.a.weight" else torch.zeros(3, 3)) for k, v in other.state_dict().items()}
    bad["inp.weight"] = torch.full_like(bad["inp.weight"], 7.0)
    with pytest.raises(RuntimeError, match="size mismatch"):
        m.load_state_dict(bad)
    assert torch.equal(infinity.full_state_dict(m)["inp.weight"], other.state_dict()["inp.weight"])
    with pytest.raises(UsageError, match="assign=True"):
        m.load_state_dict(other.state_dict(), assign=True)
    # training goes on from the loaded values as torch does
    ref = copy.deepcopy(other)
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o.state.clear()
    assert train(m, o, data(2, seed=5))[0] == pytest.approx(train(ref, ro, data(2, seed=5))[0], rel=1e-6)
    infinity.close(m)


def test_p_grad_is_none_or_raises_naming_max_grad_norm(tmp_path):
    m, o = managed(tmp_path)
    w = m.blocks[1].a.weight
    assert w.grad is None  # no gradient held: torch's None is the truth
    x, y = data(1)[0]
    m(x, y).backward()
    with pytest.raises(UsageError, match="max_grad_norm"):
        _ = w.grad
    with pytest.raises(UsageError, match="max_grad_norm"):
        w.grad = torch.zeros_like(w)
    o.step()
    o.zero_grad()
    assert w.grad is None
    infinity.close(m)


@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_backward_after_step_without_zero_grad_raises_at_the_next_step(tmp_path, overlap):
    """torch adds the new gradients to the last step's; infinity overwrote
    them, silently. The backward is taken (a zero_grad() may still drop it,
    as the DCGAN loop does); the step() that would apply the sum raises
    before anything changes, even where updates run during backward."""
    m, o = managed(tmp_path, overlap=overlap)
    (x, y), (x2, y2) = data(2)
    m(x, y).backward()
    o.step()
    before = {k: v.clone() for k, v in infinity.full_state_dict(m).items()}
    m(x2, y2).backward()
    with pytest.raises(UsageError, match=r"without optimizer.zero_grad\(\).*Nothing was changed"):
        o.step()
    after = infinity.full_state_dict(m)
    assert all(torch.equal(before[k], after[k]) for k in before)
    o.zero_grad()
    m(x2, y2).backward()
    o.step()
    infinity.close(m)


def test_model_zero_grad_and_accumulation_without_zero_grad_match_torch(tmp_path):
    """Two backwards in one window sum as in torch; model.zero_grad() (what
    Hugging Face's Trainer calls) also clears infinity's gradients."""
    m, o = managed(tmp_path)
    ref, ro = reference()
    batches = data(6)
    for net, opt in ((m, o), (ref, ro)):
        for i in range(0, 6, 2):
            for x, y in batches[i:i + 2]:
                net(x, y).backward()
            opt.step()
            net.zero_grad()
    got, want = infinity.full_state_dict(m), ref.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    infinity.close(m)


def test_extra_backward_with_backward_overlap_raises(tmp_path):
    m, o = managed(tmp_path, overlap="backward", grad_accumulation_steps=2)
    batches = data(3)
    for x, y in batches[:2]:
        m(x, y).backward()
    # The window's last backward started the updates: a forward now would use half-updated parameters
    # (it raced them: autograd saw a parameter change under it), so the forward itself is refused.
    with pytest.raises(UsageError, match=r"forward before optimizer.step\(\).*grad_accumulation_steps=2"):
        m(*batches[2])
    o.step()
    o.zero_grad()
    m(*batches[2]).backward()  # and after step() training goes on
    o.step()
    infinity.close(m)


def test_grad_scaler_is_refused_and_unscaled_fp16_warns(tmp_path):
    m, o = managed(tmp_path, dtype="fp16")
    x, y = data(1)[0]
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(m(x.half(), y.half())).backward()
    with pytest.raises(UsageError, match="scale_loss"):
        scaler.step(o)
    o.zero_grad()
    m(x.half(), y.half()).backward()
    with pytest.warns(RuntimeWarning, match="not scaled"):
        o.step()
    o.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o.scale_loss(m(x.half(), y.half())).backward()
        o.step()
    infinity.close(m)


@pytest.mark.parametrize("params,opt", [("host", "host"), ("nvme", "nvme")])
def test_close_leaves_an_ordinary_model_with_the_final_values(tmp_path, params, opt):
    """After close the model trained on NaN and step() was a no-op, silently."""
    m, o = managed(tmp_path, params, opt)
    ref, ro = reference()
    batches = data(4)
    train(m, o, batches[:2]), train(ref, ro, batches[:2])
    final = infinity.full_state_dict(m)
    infinity.close(m)
    for k, v in m.state_dict().items():
        assert type(m.get_parameter(k)) is nn.Parameter if "weight" in k or "bias" in k else True
        assert torch.equal(v, final[k]), k
    with pytest.raises(UsageError, match="close"):
        o.step()
    with pytest.raises(UsageError, match="close"):
        o.zero_grad()
    x, y = batches[2]
    with torch.no_grad():
        torch.testing.assert_close(m(x, y), ref(x, y), rtol=1e-5, atol=1e-6)  # an ordinary model now
    m2, o2 = infinity.initialize(m, infinity.Config(**base_config(offload_params=params, offload_optimizer=opt,
                                 device_memory=1 << 20, swap_paths=[str(tmp_path)])), lr=1e-2)
    assert train(m2, o2, batches[2:3])[0] == pytest.approx(ref(x, y).item(), rel=1e-6)
    infinity.close(m2)


def test_freezing_and_groups_after_initialize_are_refused(tmp_path):
    m, o = managed(tmp_path)
    with pytest.raises(UsageError, match="after infinity.initialize"):
        m.blocks[0].a.weight.requires_grad_(False)
    with pytest.raises(UsageError, match="after infinity.initialize"):
        m.blocks[0].a.weight.requires_grad = False
    with pytest.raises(UsageError, match="param_groups"):
        o.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    m.blocks[0].a.weight.requires_grad_(True)  # no change: fine
    infinity.close(m)


def test_unsupported_modes_are_refused_naming_the_way(tmp_path):
    m, o = managed(tmp_path)
    x, y = data(1)[0]
    with pytest.raises(UsageError, match="torch.compile"):
        torch.compile(m)
    with pytest.raises(UsageError, match="torch.compile"):
        m.compile()
    with torch.inference_mode(), pytest.raises(UsageError, match="torch.no_grad"):
        m(x, y)
    with torch.no_grad():
        m(x, y)  # the way named works
    infinity.close(m)
    torch.compile(nn.Linear(2, 2))  # other models compile as before


def test_sparse_embeddings_and_meta_buffers_are_refused_at_initialize():
    cfg = infinity.Config(**base_config(offload_params="host", offload_optimizer="host", device_memory=1 << 20))
    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 4))
    with pytest.raises(UsageError, match="sparse=True"):
        infinity.initialize(sparse, cfg)
    net = nn.Linear(4, 4)
    net.register_buffer("scale", torch.empty(4, device="meta"))
    with pytest.raises(UsageError, match="'scale' is on the meta device"):
        infinity.initialize(net, cfg)


def test_a_swap_path_on_tmpfs_warns_that_the_tier_is_ram():
    import tempfile

    from infinity.system import sysinfo
    if sysinfo.mount_of("/dev/shm")[1] != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        cfg = infinity.Config(**base_config(offload_params="nvme", offload_optimizer="nvme", device_memory=1 << 20,
                                            swap_paths=[d]))
        with pytest.warns(RuntimeWarning, match="RAM-backed"):
            m, o = infinity.initialize(model(), cfg)
        infinity.close(m)
