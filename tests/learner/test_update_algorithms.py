"""The learner with each advantage estimator, loss mode, KL in the reward and A-3PO."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from algorithms.advantages import ESTIMATORS
from algorithms.policy_loss import LOSS_MODES
from configs.run_schema import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    KLControlConfig,
    OptimConfig,
    PolicyLossConfig,
)
from generators.torch_engine import TorchEngine
from learner.batch import TrainBatch, collate
from learner.critic import Critic, load_value_model
from learner.model import load_sharded
from learner.optim import build_optimizer, build_scheduler
from learner.update import Learner, UpdateSettings
from learner.weights import gather_full_weights

from .test_update import LR, PROMPTS, rollouts


def make_learner(path: Path, actor: ActorConfig | None = None,
                 algorithm: AlgorithmConfig | None = None, critic_warmup: int = 0) -> Learner:
    actor = actor or ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0))
    algorithm = algorithm or AlgorithmConfig()
    model = load_sharded(str(path), compute_dtype=torch.float32, device=torch.device("cpu"))
    reference = None
    if actor.use_kl_loss or algorithm.use_kl_in_reward:
        reference = load_sharded(str(path), compute_dtype=torch.float32,
                                 device=torch.device("cpu"), trainable=False)
    optimizer = build_optimizer(model, actor.optim)
    critic = None
    if algorithm.adv_estimator == "gae":
        critic = Critic(load_value_model(str(path), compute_dtype=torch.float32,
                                         device=torch.device("cpu")),
                        CriticConfig(optim=OptimConfig(lr=1e-3, weight_decay=0.0)),
                        total_steps=10)
    settings = UpdateSettings(actor=actor, algorithm=algorithm, temperature=1.0, horizon=6,
                              num_prompts=len(PROMPTS), critic_warmup=critic_warmup)
    return Learner(model, optimizer, build_scheduler(optimizer, total_steps=10,
                                                     optim=actor.optim), settings,
                   reference=reference, critic=critic)


@pytest.fixture(scope="module")
def batch(random_model_dir: Path) -> TrainBatch:
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32,
                                         eos_ids=[2], pad_id=0, seed=3)
    batch = collate(rollouts(engine, 1), pad_id=0)
    assert batch.rewards.std() > 0
    return batch


def moved(learner: Learner, before: dict[str, torch.Tensor]) -> bool:
    after = gather_full_weights(learner.model, torch.float32)
    return all(not torch.equal(after[name], before[name]) for name in before)


def initial_weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in gather_full_weights(learner.model, torch.float32).items()}


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("estimator", sorted(set(ESTIMATORS) - {"remax"} | {"gae"}))
def test_every_estimator_trains(random_model_dir: Path, batch: TrainBatch,
                                estimator: str) -> None:
    if estimator == "grpo_passk":  # only a group's unique best sample learns: one winner each
        batch = TrainBatch(**{f: getattr(batch, f) for f in batch.__struct_fields__})
        first_of_group = torch.ones_like(batch.rewards, dtype=torch.bool)
        first_of_group[1:] = batch.group_ids[1:] != batch.group_ids[:-1]
        batch.rewards = first_of_group.float()
    learner = make_learner(random_model_dir, algorithm=AlgorithmConfig(adv_estimator=estimator))
    before = initial_weights(learner)
    metrics = learner.step(batch)
    assert math.isfinite(metrics["actor/loss"]) and metrics["actor/grad_norm"] > 0
    assert moved(learner, before)


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("mode", sorted(LOSS_MODES))
def test_every_loss_mode_trains(random_model_dir: Path, batch: TrainBatch, mode: str) -> None:
    actor = ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0),
                        policy_loss=PolicyLossConfig(loss_mode=mode, clip_cov_ratio=0.2,
                                                     kl_cov_ratio=0.2))
    learner = make_learner(random_model_dir, actor=actor)
    before = initial_weights(learner)
    metrics = learner.step(batch)
    assert math.isfinite(metrics["actor/loss"]) and metrics["actor/grad_norm"] > 0
    assert moved(learner, before)


@pytest.mark.usefixtures("one_rank_group")
def test_a3po_skips_the_proximal_forward_pass(random_model_dir: Path, batch: TrainBatch,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    actor = ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0), ppo_epochs=2)
    recompute = make_learner(random_model_dir, actor=actor)
    calls: list[int] = []
    original = Learner._no_grad_logprobs
    monkeypatch.setattr(Learner, "_no_grad_logprobs",
                        lambda self, model, b: calls.append(1) or original(self, model, b))
    recompute.step(batch, version=4)
    assert calls == [1], "recompute runs one proximal forward pass for two updates"

    calls.clear()
    a3po = make_learner(random_model_dir, actor=ActorConfig(
        optim=actor.optim, ppo_epochs=2, proximal_logprobs="a3po"))
    before = initial_weights(a3po)
    metrics = a3po.step(batch, version=4)
    assert calls == [] and math.isfinite(metrics["actor/loss"]) and moved(a3po, before)


@pytest.mark.usefixtures("one_rank_group")
def test_kl_in_reward_feeds_the_adaptive_controller(random_model_dir: Path,
                                                    batch: TrainBatch) -> None:
    algorithm = AlgorithmConfig(use_kl_in_reward=True, kl_ctrl=KLControlConfig(
        type="adaptive", kl_coef=0.1, target_kl=0.01, horizon=100))
    learner = make_learner(random_model_dir, algorithm=algorithm)
    first = learner.step(batch)
    # Policy == reference before the first update: KL 0, so the coefficient shrinks by the
    # clipped error: 0.1 * (1 - 0.2 * B / horizon) with B = 12 samples.
    assert first["actor/reward_kl"] == pytest.approx(0.0, abs=1e-6)
    assert first["actor/reward_kl_coef"] == pytest.approx(0.1)
    assert learner.kl_ctrl.value == pytest.approx(0.1 * (1 - 0.2 * batch.rows / 100))
    second = learner.step(batch)
    assert second["actor/reward_kl"] > 0, "the policy has moved away from the reference"


@pytest.mark.usefixtures("one_rank_group")
def test_rejection_masks_are_counted(random_model_dir: Path, batch: TrainBatch) -> None:
    from configs.run_schema import RolloutCorrectionConfig

    # Behavior log-probs shifted by -1 on every token: ratio proximal / behavior = e > 2, so
    # token rejection outside [0.5, 2] drops every token and nothing is learned.
    shifted = TrainBatch(**{f: getattr(batch, f) for f in batch.__struct_fields__})
    shifted.behavior_logprobs = batch.behavior_logprobs - batch.response_mask
    correction = RolloutCorrectionConfig(rollout_rs="token")
    learner = make_learner(random_model_dir, algorithm=AlgorithmConfig(
        rollout_correction=correction))
    metrics = learner.step(shifted)
    assert metrics["actor/rejected_frac"] == pytest.approx(1.0)
    assert metrics["actor/importance_weight_mean"] == pytest.approx(math.e, rel=1e-4)


@pytest.mark.usefixtures("one_rank_group")
def test_ppo_critic_learns_the_returns_and_warms_up_first(random_model_dir: Path,
                                                          batch: TrainBatch) -> None:
    learner = make_learner(random_model_dir, algorithm=AlgorithmConfig(adv_estimator="gae"),
                           critic_warmup=2)
    before = initial_weights(learner)
    errors = []
    for version in range(4):
        metrics = learner.step(batch, version=version)
        errors.append(metrics["critic/vf_mse"])
        if version < 2:  # warm-up: only the critic trains
            assert "actor/loss" not in metrics and not moved(learner, before)
    assert "actor/loss" in metrics and moved(learner, before)
    # The zero-initialised head predicts 0 at first; fitting the same returns again and again
    # must shrink the error.
    assert errors[-1] < errors[0]
