"""The learner with each advantage estimator, loss mode, KL in the reward and A-3PO."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

from algorithms.advantages import ESTIMATORS
from algorithms.policy_loss import LOSS_MODES
from configs.run_schema import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    KLControlConfig,
    OptimConfig,
    PolicyLossConfig,
    PrmModelConfig,
    RewardModelConfig,
)
from generators.torch_engine import TorchEngine
from learner.batch import TrainBatch, collate
from learner.critic import Critic, load_value_model
from learner.implicit_prm import ImplicitPRM
from learner.model import load_sharded
from learner.optim import build_optimizer, build_scheduler
from learner.update import Learner, UpdateSettings
from learner.weights import gather_full_weights

from ..conftest import save_random_model
from .test_update import LR, PROMPTS, rollouts


def make_learner(path: Path, actor: ActorConfig | None = None,
                 algorithm: AlgorithmConfig | None = None, critic_warmup: int = 0,
                 reward_model: RewardModelConfig | None = None,
                 critic_path: Path | None = None, prm_path: Path | None = None) -> Learner:
    """A learner wired as ``learner.main.build_learner`` wires it; the critic and the PRM
    start from ``critic_path`` / ``prm_path`` when given, else from the policy's ``path``."""
    actor = actor or ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0))
    algorithm = algorithm or AlgorithmConfig()
    model = load_sharded(str(path), compute_dtype=torch.float32, device=torch.device("cpu"))
    reference = prm = None
    if actor.use_kl_loss or algorithm.use_kl_in_reward or (
            algorithm.adv_estimator == "prime" and prm_path is None):
        reference = load_sharded(str(path), compute_dtype=torch.float32,
                                 device=torch.device("cpu"), trainable=False)
    if algorithm.adv_estimator == "prime":
        prm_reference = reference if prm_path is None else load_sharded(
            str(prm_path), compute_dtype=torch.float32, device=torch.device("cpu"),
            trainable=False)
        prm = ImplicitPRM(load_sharded(str(prm_path or path), compute_dtype=torch.float32,
                                       device=torch.device("cpu")), prm_reference,
                          reward_model or RewardModelConfig(
                              model=PrmModelConfig(optim=OptimConfig(lr=1e-3,
                                                                     weight_decay=0.0))),
                          total_steps=10, temperature=1.0)
    optimizer = build_optimizer(model, actor.optim)
    critic = None
    if algorithm.adv_estimator == "gae":
        critic = Critic(load_value_model(str(critic_path or path), compute_dtype=torch.float32,
                                         device=torch.device("cpu")),
                        CriticConfig(optim=OptimConfig(lr=1e-3, weight_decay=0.0)),
                        total_steps=10)
    settings = UpdateSettings(actor=actor, algorithm=algorithm, temperature=1.0, horizon=6,
                              num_prompts=len(PROMPTS), critic_warmup=critic_warmup)
    return Learner(model, optimizer, build_scheduler(optimizer, total_steps=10,
                                                     optim=actor.optim), settings,
                   reference=reference, critic=critic, prm=prm)


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
@pytest.mark.parametrize("estimator", sorted(set(ESTIMATORS) | {"gae", "prime"}))
def test_every_estimator_trains(random_model_dir: Path, batch: TrainBatch,
                                estimator: str) -> None:
    batch = TrainBatch(**{f: getattr(batch, f) for f in batch.__struct_fields__})
    if estimator == "grpo_passk":  # only a group's unique best sample learns: one winner each
        first_of_group = torch.ones_like(batch.rewards, dtype=torch.bool)
        first_of_group[1:] = batch.group_ids[1:] != batch.group_ids[:-1]
        batch.rewards = first_of_group.float()
    if estimator == "remax":  # the generators' greedy baselines: here, half of the rewards
        batch.baseline_rewards = torch.full_like(batch.rewards, 0.5)
    learner = make_learner(random_model_dir, algorithm=AlgorithmConfig(adv_estimator=estimator))
    before = initial_weights(learner)
    metrics = learner.step(batch).metrics
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
    metrics = learner.step(batch).metrics
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
    metrics = a3po.step(batch, version=4).metrics
    assert calls == [] and math.isfinite(metrics["actor/loss"]) and moved(a3po, before)


@pytest.mark.usefixtures("one_rank_group")
def test_kl_in_reward_feeds_the_adaptive_controller(random_model_dir: Path,
                                                    batch: TrainBatch) -> None:
    algorithm = AlgorithmConfig(use_kl_in_reward=True, kl_ctrl=KLControlConfig(
        type="adaptive", kl_coef=0.1, target_kl=0.01, horizon=100))
    learner = make_learner(random_model_dir, algorithm=algorithm)
    first = learner.step(batch).metrics
    # Policy == reference before the first update: KL 0, so the coefficient shrinks by the
    # clipped error: 0.1 * (1 - 0.2 * B / horizon) with B = 12 samples.
    assert first["actor/reward_kl"] == pytest.approx(0.0, abs=1e-6)
    assert first["actor/reward_kl_coef"] == pytest.approx(0.1)
    assert learner.kl_ctrl.value == pytest.approx(0.1 * (1 - 0.2 * batch.rows / 100))
    second = learner.step(batch).metrics
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
    metrics = learner.step(shifted).metrics
    assert metrics["actor/rejected_frac"] == pytest.approx(1.0)
    assert metrics["actor/importance_weight_mean"] == pytest.approx(math.e, rel=1e-4)


@pytest.mark.usefixtures("one_rank_group")
def test_rejected_tokens_stay_in_each_sequences_denominator(random_model_dir: Path,
                                                            batch: TrainBatch) -> None:
    from configs.run_schema import RolloutCorrectionConfig

    # Behavior log-probs shifted by -1 on the tail of each response: ratio e > 2 there, so
    # token rejection drops those tokens; row i keeps its first ceil(L * (i % 4 + 1) / 4)
    # tokens (on-policy). At the first update the PPO ratio is 1 and IS is off, so a kept
    # token's loss is -A_s and seq-mean-token-mean over S sequences is
    # sum_s -A_s * kept_s / L_s / S  (L_s: the whole response, rejected tokens included).
    response = batch.response_mask
    lengths = response.sum(-1)
    kept = torch.ceil(lengths * (torch.arange(batch.rows) % 4 + 1) / 4)
    tail = (response.cumsum(-1) > kept[:, None]) & response.bool()
    shifted = TrainBatch(**{f: getattr(batch, f) for f in batch.__struct_fields__})
    shifted.behavior_logprobs = batch.behavior_logprobs - tail.float()
    actor = ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0),
                        loss_agg_mode="seq-mean-token-mean")
    correction = RolloutCorrectionConfig(rollout_is="none", rollout_rs="token")
    learner = make_learner(random_model_dir, actor=actor,
                           algorithm=AlgorithmConfig(rollout_correction=correction))
    metrics = learner.step(shifted).metrics

    advantages = torch.zeros(batch.rows, dtype=torch.float64)
    for group in batch.group_ids.unique():
        rows = batch.group_ids == group
        rewards = batch.rewards[rows].double()
        advantages[rows] = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    expected = (-advantages * kept / lengths.clamp(min=1)).sum() / batch.rows
    assert abs(expected) > 1e-3  # the rejected fractions differ, so the groups do not cancel
    assert metrics["actor/rejected_frac"] == pytest.approx(float(tail.sum() / response.sum()),
                                                           abs=1e-6)
    assert metrics["actor/loss"] == pytest.approx(float(expected), abs=1e-5)


@pytest.mark.usefixtures("one_rank_group")
def test_ppo_critic_learns_the_returns_and_warms_up_first(random_model_dir: Path,
                                                          batch: TrainBatch) -> None:
    learner = make_learner(random_model_dir, algorithm=AlgorithmConfig(adv_estimator="gae"),
                           critic_warmup=2)
    before = initial_weights(learner)
    errors, updated = [], []
    for step in range(4):  # the version stays 0: nothing is published during the warm-up
        result = learner.step(batch, version=max(0, step - 2))
        errors.append(result.metrics["critic/vf_mse"])
        updated.append(result.policy_updated)
        if step < 2:  # warm-up: only the critic trains, counted in learner steps
            assert "actor/loss" not in result.metrics and not moved(learner, before)
    assert updated == [False, False, True, True]
    assert "actor/loss" in result.metrics and moved(learner, before)
    # The zero-initialised head predicts 0 at first; fitting the same returns again and again
    # must shrink the error.
    assert errors[-1] < errors[0]


def with_sample_weights(batch: TrainBatch, weights: torch.Tensor) -> TrainBatch:
    fields = {f: getattr(batch, f) for f in batch.__struct_fields__}
    return TrainBatch(**{**fields, "sample_weights": weights})


@pytest.mark.usefixtures("one_rank_group")
def test_replay_importance_weights_scale_each_rows_loss(random_model_dir: Path,
                                                        batch: TrainBatch) -> None:
    full = make_learner(random_model_dir).step(batch).metrics
    half = make_learner(random_model_dir).step(
        with_sample_weights(batch, torch.full_like(batch.rewards, 0.5))).metrics
    assert half["actor/grad_norm"] == pytest.approx(0.5 * full["actor/grad_norm"], rel=1e-4)
    # the loss is linear in the weights: one row alone plus the others alone is the whole
    # (a group's samples have equal lengths here, so a whole group's token-mean loss is 0)
    learning = next(g for g in batch.group_ids.unique()
                    if batch.rewards[batch.group_ids == g].std() > 0)
    first = torch.zeros_like(batch.rewards)
    first[int((batch.group_ids == learning).nonzero()[0])] = 1.0
    parts = [make_learner(random_model_dir).step(with_sample_weights(batch, w)).metrics
             for w in (first, 1.0 - first)]
    assert abs(parts[0]["actor/loss"]) > 1e-3
    assert parts[0]["actor/loss"] + parts[1]["actor/loss"] == pytest.approx(full["actor/loss"],
                                                                           abs=1e-6)


@pytest.mark.usefixtures("one_rank_group")
def test_ppo_reports_each_groups_td_error(random_model_dir: Path, batch: TrainBatch) -> None:
    learner = make_learner(random_model_dir, algorithm=AlgorithmConfig(adv_estimator="gae",
                                                                       lam=1.0))
    result = learner.step(batch)
    groups = int(batch.group_ids.max()) + 1
    assert len(result.td_errors) == groups
    # The value head starts at 0 and gamma = lam = 1: R_t = the sample's reward at every
    # response token, so each group's TD-error is its token-weighted mean |reward|.
    tokens = batch.response_mask.sum(-1)
    for g in range(groups):
        rows = batch.group_ids == g
        expected = float((batch.rewards[rows].abs() * tokens[rows]).sum() / tokens[rows].sum())
        assert result.td_errors[g] == pytest.approx(expected, rel=1e-5)
    assert make_learner(random_model_dir).step(batch).td_errors == []


@pytest.mark.usefixtures("one_rank_group")
def test_remax_without_greedy_baselines_names_the_problem(random_model_dir: Path,
                                                         batch: TrainBatch) -> None:
    learner = make_learner(random_model_dir, algorithm=AlgorithmConfig(adv_estimator="remax"))
    with pytest.raises(ValueError, match="greedy baseline"):
        learner.step(batch)  # collated from groups that carry no baseline_reward


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("update", ["before", "after"])
def test_prime_trains_its_prm_towards_the_outcome_labels(random_model_dir: Path,
                                                        batch: TrainBatch, update: str) -> None:
    config = RewardModelConfig(model=PrmModelConfig(update=update, beta_train=0.5, optim=(
        OptimConfig(lr=1e-3, weight_decay=0.0))))
    learner = make_learner(random_model_dir, algorithm=AlgorithmConfig(adv_estimator="prime"),
                           reward_model=config)
    losses = [learner.step(batch, version=v).metrics["prm/loss"] for v in range(4)]
    # the PRM starts equal to the reference: implicit reward 0, BCE log 2 for every label
    assert losses[0] == pytest.approx(math.log(2), rel=1e-4)
    assert losses[-1] < losses[0]
    assert learner.step(batch).metrics["prm/accuracy"] > 0.5


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another checkpoint with the policy's tokenizer but different weights."""
    return save_random_model(tmp_path_factory.mktemp("other-model"), seed=1)


@pytest.mark.usefixtures("one_rank_group")
def test_a_prm_from_its_own_checkpoint_is_scored_against_that_checkpoint(
        random_model_dir: Path, other_model_dir: Path, batch: TrainBatch) -> None:
    learner = make_learner(random_model_dir, algorithm=AlgorithmConfig(adv_estimator="prime"),
                           prm_path=other_model_dir)
    # implicit reward log(pi_phi / pi_ref) starts at 0 only if pi_ref is the PRM's own start
    assert learner.step(batch).metrics["prm/loss"] == pytest.approx(math.log(2), rel=1e-4)


@pytest.mark.usefixtures("one_rank_group")
def test_a_critic_from_its_own_checkpoint_loads_that_body(random_model_dir: Path,
                                                          other_model_dir: Path) -> None:
    learner = make_learner(random_model_dir, algorithm=AlgorithmConfig(adv_estimator="gae"),
                           critic_path=other_model_dir)
    assert learner.critic is not None
    body = gather_full_weights(learner.critic.model, torch.float32)
    other = AutoModel.from_pretrained(other_model_dir).state_dict()
    policy = AutoModel.from_pretrained(random_model_dir).state_dict()
    name = "embed_tokens.weight"
    assert torch.equal(body[f"body.{name}"], other[name])
    assert not torch.equal(other[name], policy[name])
