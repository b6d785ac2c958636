"""InfinityTrainer resumes only from a checkpoint-N folder of its own (issue
34, "Foreign step folders"): ``resume_from_checkpoint=True`` takes the
highest ``checkpoint-N`` in the output folder, so one planted there by
another user (or writable by others, or a link) would choose the run's
weights. It is refused with a UsageError naming it before the Trainer reads
anything from it: the model's weights and the Trainer's step are as before."""

import os
import re
import shutil

import pytest
import torch

import infinity
from infinity.engine.faults import UsageError

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from test_hf_integration import BUILDERS, config, dataset, training_args  # noqa: E402
from owner_utils import foreign  # noqa: E402

from infinity.integrations.hf import InfinityTrainer  # noqa: E402


def _trainer(tmp_path, seed):
    build, unit = BUILDERS["llama"]
    torch.manual_seed(seed)
    return InfinityTrainer(model=build(), args=training_args(tmp_path / "out", max_steps=2), train_dataset=dataset(),
                           infinity_config=config(unit, tmp_path))


@pytest.fixture
def out(tmp_path):
    """An output folder holding this user's checkpoint-2 (private: InfinityTrainer makes it 0700), and the
    weights it holds."""
    tr = _trainer(tmp_path, 0)
    tr.train()
    want = infinity.full_state_dict(tr.model)
    infinity.close(tr.model)
    ours = tmp_path / "out" / "checkpoint-2"
    assert os.stat(ours).st_mode & 0o777 == 0o700
    return tmp_path / "out", want


PLANTS = {
    "another user's": ("owned by uid \\d+, not by this process's uid", None),
    "group-writable": ("has mode 0770: group or others may write", None),
    "a link": ("is not a folder \\(a link or a file\\)", None),
    "another user's step folder inside": ("holds no complete checkpoint of this user's",
                                          "infinity checkpoints: .*step-00000002 is skipped: .*owned by uid"),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_foreign_checkpoint_folder_is_refused_before_anything_changes(out, tmp_path, monkeypatch, plant):
    out, _ = out
    match, warned = PLANTS[plant]
    planted = out / "checkpoint-99"  # a whole checkpoint (a copy of ours): only who owns it tells them apart
    if plant == "a link":
        shutil.copytree(out / "checkpoint-2", tmp_path / "elsewhere")
        planted.symlink_to(tmp_path / "elsewhere")
    else:
        shutil.copytree(out / "checkpoint-2", planted)
    if plant == "another user's":
        foreign(monkeypatch, planted)
    elif plant == "group-writable":
        os.chmod(planted, 0o770)
    elif plant == "another user's step folder inside":
        foreign(monkeypatch, planted / "infinity" / "step-00000002")
    tr = _trainer(tmp_path, 123)
    before = infinity.full_state_dict(tr.model)
    with pytest.raises(UsageError, match=f"resume_from_checkpoint: '{re.escape(str(planted))}'.*{match}") as e:
        if warned:
            with pytest.warns(RuntimeWarning, match=warned):
                tr.train(resume_from_checkpoint=True)
        else:
            tr.train(resume_from_checkpoint=True)
    assert str(planted) in str(e.value)
    after = infinity.full_state_dict(tr.model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert tr.state.global_step == 0
    infinity.close(tr.model)


def test_our_own_newest_checkpoint_resumes(out, tmp_path):
    """The control: the same call with only this user's private checkpoint-2 resumes from it, its
    weights loaded before the Trainer goes on (which it does for one step past max_steps=2)."""
    out, want = out
    tr = _trainer(tmp_path, 123)
    assert not torch.equal(infinity.full_state_dict(tr.model)["lm_head.weight"], want["lm_head.weight"])
    loaded = []
    real = InfinityTrainer._load_optimizer_and_scheduler

    def spy(self, checkpoint):
        real(self, checkpoint)
        loaded.append((checkpoint, infinity.full_state_dict(self.model)))
    tr._load_optimizer_and_scheduler = spy.__get__(tr)
    tr.train(resume_from_checkpoint=True)
    ((path, got),) = loaded
    assert path == str(out / "checkpoint-2") and all(torch.equal(got[k], want[k]) for k in want)
    assert [h["step"] for h in tr.state.log_history if "loss" in h][-1] > 2  # trained on from step 2
    infinity.close(tr.model)
