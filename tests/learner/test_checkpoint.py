"""Checkpoints hold every trained model with its optimizer: the policy, and the critic (PPO)
or the implicit PRM (PRIME) where the algorithm has one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_state_dict

from configs.run_schema import AlgorithmConfig
from generators.torch_engine import TorchEngine
from learner.batch import TrainBatch, collate
from learner.checkpoint import checkpoint_state, save_checkpoint
from learner.weights import gather_full_weights

from .test_update import rollouts
from .test_update_algorithms import make_learner


@pytest.fixture(scope="module")
def batch(random_model_dir: Path) -> TrainBatch:
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32,
                                         eos_ids=[2], pad_id=0, seed=5)
    return collate(rollouts(engine, 1), pad_id=0)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in gather_full_weights(model, torch.float32).items()}


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("estimator, part", [("gae", "critic"), ("prime", "prm")])
def test_the_critic_and_the_prm_are_saved_with_their_optimizers(
        random_model_dir: Path, batch: TrainBatch, tmp_path: Path, estimator: str,
        part: str) -> None:
    algorithm = AlgorithmConfig(adv_estimator=estimator)
    trained = make_learner(random_model_dir, algorithm=algorithm)
    untrained = full_weights(getattr(trained, part).model)
    trained.step(batch)
    saved = full_weights(getattr(trained, part).model)
    assert any(not torch.equal(saved[k], untrained[k]) for k in saved)
    target = save_checkpoint(trained, tmp_path, step=1, version=1, keep_last=2)

    fresh = make_learner(random_model_dir, algorithm=algorithm)
    state = checkpoint_state(fresh)
    assert {"model", "optim", part} <= state.keys()
    dcp.load(state, checkpoint_id=str(target / "dcp"))
    module = getattr(fresh, part)
    set_state_dict(module.model, module.optimizer, model_state_dict=state[part]["model"],
                   optim_state_dict=state[part]["optim"])
    loaded = full_weights(module.model)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    trained_moments = [s["exp_avg"] for s in getattr(trained, part).optimizer.state.values()]
    loaded_moments = [s["exp_avg"] for s in module.optimizer.state.values()]
    assert len(loaded_moments) == len(trained_moments) > 0
    assert all(torch.equal(a.full_tensor(), b.full_tensor())
               for a, b in zip(loaded_moments, trained_moments))
