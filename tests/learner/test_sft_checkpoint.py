"""SFT checkpoints: only a renamed folder with its meta counts; the newest is resumed; the
oldest are pruned past ``max_ckpt_to_keep``; a folder that is no SFT checkpoint is named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relay.configs.sft_schema import SftOptimConfig
from relay.learner.checkpoint_files import CheckpointError
from relay.learner.model import load_sharded
from relay.learner.optim import build_optimizer, build_scheduler
from relay.learner.sft_checkpoint import (
    complete_checkpoints,
    load_sft_checkpoint,
    newest_checkpoint,
    read_sft_meta,
    save_sft_checkpoint,
)


def test_only_complete_checkpoints_count(tmp_path: Path) -> None:
    for name, meta in (("global_step_2", True), ("global_step_10", True),
                       ("global_step_12.tmp", True), ("global_step_11", False),
                       ("step-30", True)):
        (tmp_path / name).mkdir()
        if meta:
            (tmp_path / name / "meta.json").write_text("{}")
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [2, 10]
    assert newest_checkpoint(tmp_path) == tmp_path / "global_step_10"
    assert newest_checkpoint(tmp_path / "absent") is None
    with pytest.raises(CheckpointError, match="global_step_10: not an SFT checkpoint"):
        read_sft_meta(tmp_path / "global_step_10")


def test_a_checkpoint_restores_weights_optimizer_and_schedule(random_model_dir: Path,
                                                             tmp_path: Path,
                                                             one_rank_group) -> None:
    def build():
        model = load_sharded(str(random_model_dir), compute_dtype=torch.float32,
                             device=torch.device("cpu"))
        optim = SftOptimConfig(lr=1e-2).as_optim()
        optimizer = build_optimizer(model, optim)
        return model, optimizer, build_scheduler(optimizer, total_steps=10, optim=optim)

    model, optimizer, scheduler = build()
    for step in (1, 2, 3):
        model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])
              ).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        save_sft_checkpoint(model, optimizer, scheduler, tmp_path, step, keep=2)
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [2, 3]  # step 1 pruned
    assert (tmp_path / "global_step_3" / "hf" / "model.safetensors").is_file()
    fresh, fresh_optimizer, fresh_scheduler = build()
    meta = load_sft_checkpoint(fresh, fresh_optimizer, fresh_scheduler, tmp_path / "global_step_3")
    assert meta.step == 3 and fresh_scheduler.last_epoch == scheduler.last_epoch
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()
    for (name, want), got in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(want.full_tensor(), got.full_tensor()), name
    want_state = [s["exp_avg"].full_tensor() for s in optimizer.state.values()]
    got_state = [s["exp_avg"].full_tensor() for s in fresh_optimizer.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(want_state, got_state, strict=True))
