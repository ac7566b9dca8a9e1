"""The learner with each advantage estimator, loss mode, KL in the reward and A-3PO."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

from relay.algorithms.advantages import ESTIMATORS
from relay.algorithms.kl import KLControlConfig
from relay.algorithms.off_policy import RolloutCorrectionConfig
from relay.algorithms.policy_loss import LOSS_MODES, PolicyLossConfig
from relay.configs.run_schema import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    OptimConfig,
    PrmModelConfig,
    RewardModelConfig,
    TrainerConfig,
)
from relay.generators.torch_engine import TorchEngine
from relay.learner.batch import TrainBatch, collate
from relay.learner.critic import Critic, load_value_model
from relay.learner.implicit_prm import ImplicitPRM
from relay.learner.model import load_sharded, sharding_mesh
from relay.learner.optim import build_optimizer, build_scheduler
from relay.learner.ulysses import Parallelism
from relay.learner.update import Learner

from ..conftest import gather_full_weights, save_random_model
from .test_update import DATA, LR, ROLLOUT, rollouts


def make_learner(path: Path, actor: ActorConfig | None = None,
                 algorithm: AlgorithmConfig | None = None, critic_warmup: int = 0,
                 reward_model: RewardModelConfig | None = None,
                 critic_path: Path | None = None, prm_path: Path | None = None,
                 parallelism: Parallelism | None = None, fsdp_size: int = -1) -> Learner:
    """A learner wired as ``relay.learner.main.build_learner`` wires it; the critic and the PRM
    start from ``critic_path`` / ``prm_path`` when given, else from the policy's ``path``;
    every model is sharded over ``fsdp_size`` ranks (``relay.learner.model.sharding_mesh``)."""
    actor = actor or ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0))
    algorithm = algorithm or AlgorithmConfig()
    mesh = sharding_mesh(torch.device("cpu"), fsdp_size)
    model = load_sharded(str(path), compute_dtype=torch.float32, device=torch.device("cpu"),
                         mesh=mesh)
    reference = prm = None
    if actor.use_kl_loss or algorithm.use_kl_in_reward or (
            algorithm.adv_estimator == "prime" and prm_path is None):
        reference = load_sharded(str(path), compute_dtype=torch.float32,
                                 device=torch.device("cpu"), trainable=False, mesh=mesh)
    if algorithm.adv_estimator == "prime":
        prm_reference = reference if prm_path is None else load_sharded(
            str(prm_path), compute_dtype=torch.float32, device=torch.device("cpu"),
            trainable=False, mesh=mesh)
        prm = ImplicitPRM(load_sharded(str(prm_path or path), compute_dtype=torch.float32,
                                       device=torch.device("cpu"), mesh=mesh), prm_reference,
                          reward_model or RewardModelConfig(
                              model=PrmModelConfig(optim=OptimConfig(lr=1e-3,
                                                                     weight_decay=0.0))),
                          total_steps=10, temperature=1.0)
    optimizer = build_optimizer(model, actor.optim)
    critic = None
    if algorithm.adv_estimator == "gae":
        critic = Critic(load_value_model(str(critic_path or path), compute_dtype=torch.float32,
                                         device=torch.device("cpu"), mesh=mesh),
                        CriticConfig(optim=OptimConfig(lr=1e-3, weight_decay=0.0)),
                        total_steps=10)
    return Learner(model, optimizer, build_scheduler(optimizer, total_steps=10,
                                                     optim=actor.optim),
                   actor=actor, algorithm=algorithm, rollout=ROLLOUT, data=DATA,
                   trainer=TrainerConfig(critic_warmup=critic_warmup),
                   reference=reference, critic=critic, prm=prm, parallelism=parallelism)


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
    # k3 (low_var_kl) is >= 0 on every token, so any move away from the reference shows
    algorithm = AlgorithmConfig(use_kl_in_reward=True, kl_penalty="low_var_kl",
                                kl_ctrl=KLControlConfig(type="adaptive", kl_coef=0.1,
                                                        target_kl=0.01, horizon=100))
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


def rejected_quarters(batch: TrainBatch) -> tuple[TrainBatch, torch.Tensor]:
    """The batch with behavior log-probs 1 below on the tail of each response (ratio e > 2:
    token rejection drops those tokens): row i keeps its first ceil(L_i (i % 4 + 1) / 4)
    tokens. Returns it and the kept counts (B,)."""
    lengths = batch.response_mask.sum(-1)
    kept = torch.ceil(lengths * (torch.arange(batch.rows) % 4 + 1) / 4)
    return rejecting_tails(batch, kept)[0], kept


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("mode", ["vanilla", "gspo", "sapo", "geo_mean"])
def test_a_sequences_mean_is_over_its_kept_tokens(random_model_dir: Path, batch: TrainBatch,
                                                 mode: str) -> None:
    # At the first update the PPO ratio is 1 and IS is off, so every kept token of row i has
    # the loss l_i = -A_i (vanilla, gspo, geo_mean) or -2 A_i / tau (sapo); aggregated with
    # seq-mean-token-mean (configured for vanilla, forced for the others) the loss is
    # (1/B) sum_i w_i l_i, as verl: the mean over row i's kept tokens. Over its whole
    # response (before issue 30) it was (1/B) sum_i w_i l_i k_i / L_i: half a sequence
    # rejected halved its objective.
    shifted, kept = rejected_quarters(with_sample_weights(batch, ROW_WEIGHTS))
    actor = ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0),
                        loss_agg_mode="seq-mean-token-mean" if mode == "vanilla"
                        else "token-mean", policy_loss=PolicyLossConfig(loss_mode=mode))
    metrics = make_learner(random_model_dir, actor=actor,
                           algorithm=TOKEN_REJECTION).step(shifted).metrics
    advantages = grpo_by_hand(batch)
    per_row = -advantages * (2 / torch.where(advantages > 0, 1.0, 1.05) if mode == "sapo" else 1)
    weighted = ROW_WEIGHTS.double() * per_row
    lengths = batch.response_mask.sum(-1).double()
    expected = float(weighted.sum() / batch.rows)
    assert abs(expected - float((weighted * kept / lengths).sum() / batch.rows)) > 1e-3
    assert metrics["actor/loss"] == pytest.approx(expected, abs=1e-5)


@pytest.mark.usefixtures("one_rank_group")
def test_rejected_tokens_stay_in_token_means_count(random_model_dir: Path,
                                                   batch: TrainBatch) -> None:
    # token-mean divides by the response's tokens, rejected ones included (AReaL's
    # convention; verl divides by the kept tokens): at ratio 1 with IS off the loss is
    # sum_i -w_i A_i k_i / sum_i L_i, not sum_i -w_i A_i k_i / sum_i k_i.
    shifted, kept = rejected_quarters(with_sample_weights(batch, ROW_WEIGHTS))
    metrics = make_learner(random_model_dir, algorithm=TOKEN_REJECTION).step(shifted).metrics
    summed = float((-grpo_by_hand(batch) * ROW_WEIGHTS.double() * kept).sum())
    lengths = batch.response_mask.sum(-1)
    assert metrics["actor/rejected_frac"] == pytest.approx(float(1 - kept.sum() / lengths.sum()),
                                                           abs=1e-6)
    assert abs(summed / float(lengths.sum()) - summed / float(kept.sum())) > 1e-3
    assert metrics["actor/loss"] == pytest.approx(summed / float(lengths.sum()), abs=1e-5)


def copy_of(batch: TrainBatch) -> TrainBatch:
    return TrainBatch(**{f: getattr(batch, f) for f in batch.__struct_fields__})


def with_varied_lengths(batch: TrainBatch) -> TrainBatch:
    """Row i keeps its first L_i - i % 4 response tokens (the fixture's are all as long; the
    rest become padding, which leaves the kept tokens' log-probs as they were)."""
    out = copy_of(batch)
    keep = batch.response_mask.sum(-1) - torch.arange(batch.rows) % 4
    out.response_mask = batch.response_mask * (batch.response_mask.cumsum(-1) <= keep[:, None])
    return out


def grpo_by_hand(batch: TrainBatch) -> torch.Tensor:
    """(r - group mean) / (unbiased group std + 1e-6) per row, (B,) float64."""
    advantages = torch.zeros(batch.rows, dtype=torch.float64)
    for group in batch.group_ids.unique():
        rows = batch.group_ids == group
        rewards = batch.rewards[rows].double()
        advantages[rows] = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    return advantages


ROW_WEIGHTS = torch.linspace(0.2, 1.0, 12)  # replay weights, so that groups do not cancel


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("mode", ["gspo", "sapo", "geo_mean"])
def test_sequence_loss_modes_are_aggregated_per_sequence_whatever_loss_agg_mode(
        random_model_dir: Path, batch: TrainBatch, mode: str) -> None:
    # verl aggregates gspo and sapo with seq-mean-token-mean and geo_mean with a mean over
    # sequences, ignoring actor.loss_agg_mode (token-mean here). At the first update the ratio
    # is 1, so every token of row i has the loss l_i = -A_i (gspo, geo_mean) or
    # -A_i (4 / tau) sigmoid(0) = -2 A_i / tau (sapo, tau 1 for A > 0, 1.05 otherwise), and
    # the loss is (1/B) sum_i w_i l_i; token-mean would weight each row by its length.
    batch = with_sample_weights(with_varied_lengths(batch), ROW_WEIGHTS)
    actor = ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0),
                        policy_loss=PolicyLossConfig(loss_mode=mode))
    metrics = make_learner(random_model_dir, actor=actor).step(batch).metrics
    advantages = grpo_by_hand(batch)
    per_row = -advantages * (2 / torch.where(advantages > 0, 1.0, 1.05) if mode == "sapo" else 1)
    weighted = ROW_WEIGHTS.double() * per_row
    lengths = batch.response_mask.sum(-1).double()
    expected = float(weighted.sum() / batch.rows)
    assert abs(expected - float((weighted * lengths).sum() / lengths.sum())) > 1e-3
    assert metrics["actor/loss"] == pytest.approx(expected, abs=1e-5)


@pytest.mark.usefixtures("one_rank_group")
def test_geo_mean_takes_the_geometric_mean_of_the_is_weights(random_model_dir: Path,
                                                             batch: TrainBatch) -> None:
    # Behavior log-probs 0.5 below the proximal ones on even positions: IS weight e^0.5 (< the
    # cap 2) there, 1 elsewhere. geo_mean's sequence loss -A_i is multiplied by the weights'
    # geometric mean over the row, exp(0.5 * n_even_i / L_i), as verl (their arithmetic mean,
    # as a per-token weight under seq-mean-token-mean, would give another number).
    batch = with_sample_weights(with_varied_lengths(batch), ROW_WEIGHTS)
    shift = torch.zeros_like(batch.behavior_logprobs)
    shift[:, ::2] = 0.5
    shift = shift * batch.response_mask
    shifted = copy_of(batch)
    shifted.behavior_logprobs = batch.behavior_logprobs - shift
    actor = ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0),
                        policy_loss=PolicyLossConfig(loss_mode="geo_mean"))
    metrics = make_learner(random_model_dir, actor=actor).step(shifted).metrics
    lengths = batch.response_mask.sum(-1).double()
    per_row = -grpo_by_hand(batch) * ROW_WEIGHTS.double()
    geometric = torch.exp(shift.double().sum(-1) / lengths)
    arithmetic = (shift.double().exp() * batch.response_mask).sum(-1) / lengths
    expected = float((per_row * geometric).sum() / batch.rows)
    assert abs(expected - float((per_row * arithmetic).sum() / batch.rows)) > 1e-4
    assert metrics["actor/loss"] == pytest.approx(expected, abs=1e-5)


def rejecting_tails(batch: TrainBatch, kept: torch.Tensor) -> tuple[TrainBatch, torch.Tensor]:
    """The batch with behavior log-probs 1 below on each row's tokens past ``kept`` (B,):
    token rejection outside [0.5, 2] drops them (ratio e). Returns it and its tail mask."""
    response = batch.response_mask
    tail = (response.cumsum(-1) > kept[:, None]) & response.bool()
    shifted = copy_of(batch)
    shifted.behavior_logprobs = batch.behavior_logprobs - tail.float()
    return shifted, tail


TOKEN_REJECTION = AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(
    rollout_is="none", rollout_rs="token"))


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("mode", ["gspo", "geo_mean"])
def test_the_loss_mode_sees_the_rejection_mask(random_model_dir: Path, batch: TrainBatch,
                                               mode: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The response mask the loss mode gets is the correction's: a rejected token leaves
    # GSPO's sequence ratio and GMPO's geometric mean (and gets no gradient through them).
    import relay.learner.update as update

    seen: list[torch.Tensor] = []
    original = update.policy_loss
    monkeypatch.setattr(update, "policy_loss",
                        lambda *args, **kw: seen.append(args[3].clone()) or original(*args, **kw))
    shifted, tail = rejecting_tails(batch, torch.full((batch.rows,), 2.0))
    actor = ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0), skip_zero_advantage=False,
                        policy_loss=PolicyLossConfig(loss_mode=mode))
    make_learner(random_model_dir, actor=actor, algorithm=TOKEN_REJECTION).step(shifted)
    order = batch.attention_mask.sum(-1).argsort(stable=True)  # one pass, rows by length
    kept = (batch.response_mask * ~tail)[order, :seen[0].shape[1]]
    assert torch.equal(seen[0], kept)


@pytest.mark.usefixtures("one_rank_group")
def test_rejection_enters_the_advantages(random_model_dir: Path, batch: TrainBatch,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # OPO's baseline is weighted by response lengths; verl rejects before compute_advantage,
    # so the lengths are the kept ones: A_i = r_i - sum_g k_j r_j / sum_g k_j. Row i keeps
    # k_i = ceil(L_i (i % 4 + 1) / 4) tokens; with one update per step the proximal pass
    # must now run up front. Loss (seq-mean-token-mean over the kept tokens, IS off, ratio
    # 1): (1/B) sum_i -w_i A_i.
    calls: list[int] = []
    original = Learner._no_grad_logprobs
    monkeypatch.setattr(Learner, "_no_grad_logprobs",
                        lambda self, model, b: calls.append(1) or original(self, model, b))
    lengths = batch.response_mask.sum(-1)
    kept = torch.ceil(lengths * (torch.arange(batch.rows) % 4 + 1) / 4)
    shifted, _ = rejecting_tails(with_sample_weights(batch, ROW_WEIGHTS), kept)
    actor = ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0),
                        loss_agg_mode="seq-mean-token-mean")
    algorithm = AlgorithmConfig(adv_estimator="opo",
                                rollout_correction=TOKEN_REJECTION.rollout_correction)
    metrics = make_learner(random_model_dir, actor=actor, algorithm=algorithm).step(
        shifted).metrics
    assert calls == [1], "rejection needs the proximal log-probs before the advantages"

    def loss_with_baseline_weights(weights: torch.Tensor) -> float:
        rewards = batch.rewards.double()
        advantages = torch.zeros(batch.rows, dtype=torch.float64)
        for group in batch.group_ids.unique():
            rows = batch.group_ids == group
            baseline = (weights[rows].double() * rewards[rows]).sum() / weights[rows].sum()
            advantages[rows] = rewards[rows] - baseline
        return float((-advantages * ROW_WEIGHTS.double()).sum() / batch.rows)

    expected = loss_with_baseline_weights(kept)
    assert abs(expected) > 1e-3
    assert abs(expected - loss_with_baseline_weights(lengths)) > 1e-3  # kept, not L
    assert metrics["actor/loss"] == pytest.approx(expected, abs=1e-5)


@pytest.mark.usefixtures("one_rank_group")
def test_rejected_tokens_add_no_entropy_or_kl_loss(random_model_dir: Path,
                                                   batch: TrainBatch) -> None:
    # Every token rejected (behavior 1 below: ratio e > 2), with an entropy bonus and a KL
    # loss against a reference moved away from the policy: nothing is left to train on, so
    # the loss and the gradient are 0 (the entropy and KL terms must be masked too).
    shifted, _ = rejecting_tails(batch, torch.zeros(batch.rows))
    actor = ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0), entropy_coeff=0.01,
                        use_kl_loss=True)
    learner = make_learner(random_model_dir, actor=actor, algorithm=AlgorithmConfig(
        rollout_correction=RolloutCorrectionConfig(rollout_rs="token")))
    with torch.no_grad():
        for parameter in learner.reference.parameters():
            parameter.add_(0.05)
    metrics = learner.step(shifted).metrics
    assert metrics["actor/rejected_frac"] == pytest.approx(1.0)
    assert metrics["actor/loss"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["actor/grad_norm"] == pytest.approx(0.0, abs=1e-7)


@pytest.mark.usefixtures("one_rank_group")
def test_rows_without_response_tokens_are_not_counted_as_sequences(random_model_dir: Path,
                                                                   batch: TrainBatch) -> None:
    # Row 0's response is emptied: B = 11 sequences in seq-mean-token-mean, not 12. Its
    # reward still counts in its group's GRPO statistics (as in verl). Ratio 1: the loss is
    # (1/11) sum_{i > 0} -w_i A_i.
    empty = with_sample_weights(batch, ROW_WEIGHTS)
    empty.response_mask = batch.response_mask.clone()
    empty.response_mask[0] = 0.0
    actor = ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0),
                        loss_agg_mode="seq-mean-token-mean")
    metrics = make_learner(random_model_dir, actor=actor).step(empty).metrics
    advantages = grpo_by_hand(batch)
    advantages[0] = 0.0
    expected = float((-advantages * ROW_WEIGHTS.double()).sum() / (batch.rows - 1))
    assert metrics["actor/loss"] == pytest.approx(expected, abs=1e-5)


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
