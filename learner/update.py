"""One learner step: log-probs, advantages, the staleness-corrected loss, optimizer steps.

The batch is the whole global batch on every rank (rank 0 broadcast it); each rank trains
on rows ``rank::world`` of every mini-batch. Losses are sums divided by counts over the
whole mini-batch (``algorithms.aggregation``), multiplied by the world size because FSDP
averages gradients across ranks: so the update does not depend on the number of ranks or
micro-batches. Every rank runs the same number of forward/backward passes (FSDP's
collectives need it); a rank with fewer rows pads with a zero-weighted pass.

Per token, the loss is the configured surrogate (``algorithms.policy_loss``, ratio current /
proximal) times the off-policy correction (``algorithms.off_policy``: truncated importance
weight proximal / behavior, rejection masks). Tokens a correction rejects contribute zero
loss but still count in the aggregation's denominators, so rejecting never up-weights the
tokens that remain (and the update stays independent of ranks and micro-batches).

Proximal log-probs are the policy's before this step's first optimizer step. With one
update per step (one epoch, one mini-batch) they equal the detached log-probs of the same
forward pass, which saves a forward pass. Otherwise they are recomputed up front
(``actor.proximal_logprobs = "recompute"``) or, for every update after the first,
interpolated between behavior and current log-probs by version (``"a3po"``), where the
j-th of the step's u updates counts as version ``v + j / u``. KL in the reward and M2PO
(a batch-level mask) need them up front in every case. Every up-front pass (proximal,
reference, PRIME's PRM) gives each rank the whole batch: each rank computes the rows it
trains on and the ranks sum them, so batch-level quantities (KL in the reward, M2PO's second
moment, PRIME's process rewards) are the same at any number of ranks.

Advantages are computed once per step on the whole batch (``algorithms.advantages``), after
KL in the reward, when on, has added ``-beta * KL(proximal || reference)`` per token. ReMax
takes each group's greedy baseline reward from the batch; PRIME trains its implicit PRM
(``learner.implicit_prm``) and adds its token rewards (``algorithms.prime``). With
``gae`` the critic predicts the values first, trains on this step's returns, and for the
first ``trainer.critic_warmup`` steps the actor does not update; each group's mean
|return - value| is its TD-error, the priority of prioritized replay by ``td_error``.
Under prioritized replay each row's policy and value losses are multiplied by its group's
importance weight (``TrainBatch.sample_weights``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import msgspec
import torch
import torch.distributed as dist
from torch import nn

from algorithms.advantages import (
    AdvantageInputs,
    AdvantageParams,
    compute_advantages,
    gae_advantages,
    group_sum,
    token_level_rewards,
)
from algorithms.aggregation import aggregate_loss
from algorithms.kl import kl_penalty, kl_reward_penalty, make_kl_controller
from algorithms.off_policy import (
    Correction,
    CorrectionParams,
    a3po_proximal_logprobs,
    off_policy_correction,
)
from algorithms.policy_loss import PolicyLossParams, PolicyLossTerms, policy_loss
from algorithms.prime import implicit_process_rewards, prime_advantages
from configs.run_schema import ActorConfig, AlgorithmConfig
from learner.batch import TrainBatch
from learner.critic import Critic
from learner.implicit_prm import ImplicitPRM
from learner.model import forward_logprobs
from learner.optim import clipped_step


class StepResult(msgspec.Struct, frozen=True):
    """Rank-reduced diagnostics; per group of the batch (by group id) the mean TD-error
    |R_t - V_t| over its response tokens (empty without a critic); whether the policy
    changed (False during the critic's warm-up)."""

    metrics: dict[str, float]
    td_errors: list[float] = []
    policy_updated: bool = True


def group_td_errors(returns: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                    group_ids: torch.Tensor) -> list[float]:
    """mean over each group's response tokens of |R_t - V_t|; all inputs (B, T) but
    ``group_ids`` (B,)."""
    groups = int(group_ids.max()) + 1
    errors = ((returns - values).abs() * response_mask).sum(-1).double()
    tokens = response_mask.sum(-1).double()
    return (group_sum(errors, group_ids, groups)
            / group_sum(tokens, group_ids, groups).clamp(min=1.0)).tolist()


class UpdateSettings(msgspec.Struct, kw_only=True, frozen=True):
    """What the update reads from the run config."""

    actor: ActorConfig
    algorithm: AlgorithmConfig
    temperature: float  # the rollout temperature: log-probs of softmax(logits / T)
    horizon: int  # rollout.response_length, the constant of seq-mean-token-sum-norm
    num_prompts: int  # groups in the batch (data.train_batch_size)
    critic_warmup: int = 0  # trainer.critic_warmup: the first steps update only the critic


def _chunks(rows: torch.Tensor, count: int) -> list[torch.Tensor]:
    """``count`` nearly equal, possibly empty, pieces of ``rows``."""
    return [rows[i::count] for i in range(count)] if count else []


class _Sums:
    """Diagnostics as sums (and maxima), all-reduced once at the end of the step."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.maxima: dict[str, float] = {}

    def add(self, name: str, value: torch.Tensor | float) -> None:
        self.values[name] = self.values.get(name, 0.0) + float(value)

    def max(self, name: str, value: float) -> None:
        self.maxima[name] = max(self.maxima.get(name, -math.inf), value)

    def reduced(self, group: dist.ProcessGroup | None) -> dict[str, float]:
        return {**_all_reduce(self.values, dist.ReduceOp.SUM, group),
                **_all_reduce(self.maxima, dist.ReduceOp.MAX, group)}


def _all_reduce(values: dict[str, float], op: dist.ReduceOp,
                group: dist.ProcessGroup | None) -> dict[str, float]:
    names = sorted(values)
    packed = torch.tensor([values[n] for n in names], dtype=torch.float64)
    if dist.is_initialized() and names:
        dist.all_reduce(packed, op=op, group=group)
    return dict(zip(names, packed.tolist()))


class Learner:
    """The policy being trained, its optimizer and schedule, and the optional reference."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, settings: UpdateSettings,
                 reference: nn.Module | None = None, critic: Critic | None = None,
                 prm: ImplicitPRM | None = None, group: dist.ProcessGroup | None = None) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.settings, self.reference, self.critic, self.prm, self.group = (
            settings, reference, critic, prm, group)
        self.steps_done = 0  # learner steps taken, counting the critic's warm-up
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        actor, algorithm = settings.actor, settings.algorithm
        if algorithm.adv_estimator == "gae" and critic is None:
            raise ValueError("algorithm.adv_estimator = 'gae' needs the critic")
        if algorithm.adv_estimator == "prime" and prm is None:
            raise ValueError("algorithm.adv_estimator = 'prime' needs the implicit PRM")
        if (actor.use_kl_loss or algorithm.use_kl_in_reward) and reference is None:
            raise ValueError("KL (actor.use_kl_loss or algorithm.use_kl_in_reward) needs the "
                             "frozen reference model")
        self.loss_params = PolicyLossParams(
            clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
            clip_ratio_c=actor.clip_ratio_c, **msgspec.structs.asdict(actor.policy_loss))
        self.correction = CorrectionParams(
            **msgspec.structs.asdict(algorithm.rollout_correction))
        ctrl = algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(ctrl.type, ctrl.kl_coef, ctrl.target_kl,
                                          ctrl.horizon) if algorithm.use_kl_in_reward else None

    def mini_batches(self, batch: TrainBatch) -> Iterator[torch.Tensor]:
        """Row indices of each mini-batch (whole groups, in order)."""
        per_mini = self.settings.actor.ppo_mini_batch_size or self.settings.num_prompts
        groups = torch.unique(batch.group_ids)
        for start in range(0, len(groups), per_mini):
            chosen = groups[start:start + per_mini]
            yield torch.isin(batch.group_ids, chosen).nonzero().squeeze(-1)

    def step(self, batch: TrainBatch, version: int = 0) -> StepResult:
        """One learner step on the global ``batch`` by the policy at ``version``."""
        actor, algorithm = self.settings.actor, self.settings.algorithm
        minis = list(self.mini_batches(batch))
        updates = actor.ppo_epochs * len(minis)
        self.model.train()
        upfront = (updates > 1 and actor.proximal_logprobs == "recompute") \
            or algorithm.use_kl_in_reward or self.correction.m2po
        proximal = self._no_grad_logprobs(self.model, batch) if upfront else None
        reference = self._no_grad_logprobs(self.reference, batch) if self.reference else None
        extra: dict[str, float] = {}
        token_rewards = None
        td_errors: list[float] = []
        if self.kl_ctrl is not None:
            token_rewards, sequence_kl = kl_reward_penalty(
                proximal, reference, batch.response_mask, self.kl_ctrl.value,
                algorithm.kl_penalty)
            extra["actor/reward_kl_coef"] = self.kl_ctrl.value
            extra["actor/reward_kl"] = float(sequence_kl.mean())
            self.kl_ctrl.update(float(sequence_kl.mean()), n_steps=batch.rows)
        inputs = AdvantageInputs(rewards=batch.rewards, group_ids=batch.group_ids,
                                 response_mask=batch.response_mask, token_rewards=token_rewards,
                                 baseline_rewards=self._greedy_baselines(batch))
        if self.critic is not None:
            old_values = self.critic.values(batch, minis, self._local_rows)
            advantages, returns = gae_advantages(token_level_rewards(inputs), old_values,
                                                 batch.response_mask, algorithm.gamma,
                                                 algorithm.lam)
            td_errors = group_td_errors(returns, old_values, batch.response_mask,
                                        batch.group_ids)
            extra.update(self.critic.train(batch, minis, self._local_rows, old_values,
                                           returns, self.settings.horizon))
            if self.steps_done < self.settings.critic_warmup:
                self.steps_done += 1
                return StepResult({**extra, "actor/updates_skipped": float(updates)}, td_errors,
                                  policy_updated=False)
        elif self.prm is not None:
            advantages, extra_prm = self._prime_advantages(batch, minis, reference)
            extra.update(extra_prm)
        else:
            advantages = compute_advantages(
                algorithm.adv_estimator, inputs,
                AdvantageParams(norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
                                gamma=algorithm.gamma))
        correction = None
        if proximal is not None:
            correction = off_policy_correction(proximal, batch.behavior_logprobs,
                                               batch.response_mask, self.correction)
        sums = _Sums()
        grad_norms: list[float] = []
        for epoch in range(actor.ppo_epochs):
            for index, mini in enumerate(minis):
                self.optimizer.zero_grad(set_to_none=True)
                done = epoch * len(minis) + index
                self._accumulate(batch, mini, advantages, proximal, reference, correction,
                                 version + done / updates, version, sums)
                grad_norms.append(self._optimizer_step(sums))
        self.scheduler.step()
        stats = sums.reduced(self.group)
        tokens = max(stats.get("tokens", 0.0), 1.0)
        metrics = {name.removesuffix("_sum"): value / tokens for name, value in stats.items()
                   if name.endswith("_sum")}
        metrics.update(extra)
        metrics.update({
            "actor/importance_weight_max": stats.get("actor/importance_weight_max", 0.0),
            "actor/grad_norm": sum(grad_norms) / updates,
            "actor/lr": self.scheduler.get_last_lr()[0],
            "actor/updates_skipped": stats.get("skipped", 0.0) / self.world,
            "actor/loss": stats.get("loss", 0.0) / updates,
            "actor/tokens": stats.get("tokens", 0.0) / actor.ppo_epochs,
        })
        self.steps_done += 1
        return StepResult(metrics, td_errors)

    # -- internals ----------------------------------------------------------------------

    def _greedy_baselines(self, batch: TrainBatch) -> torch.Tensor | None:
        """ReMax's baselines (B,), or None for the other estimators."""
        if self.settings.algorithm.adv_estimator != "remax":
            return None
        if bool(batch.baseline_rewards.isnan().any()):
            raise ValueError("remax needs every group's greedy baseline reward "
                             "(RolloutGroup.baseline_reward); some groups came without one")
        return batch.baseline_rewards

    def _prime_advantages(self, batch: TrainBatch, minis: list[torch.Tensor],
                          reference: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
        """PRIME: train the implicit PRM (before or after scoring), score the batch's tokens,
        combine with the outcome rewards (``algorithms.prime``). ``reference``: the policy's
        reference log-probs, reused when the PRM shares that reference model."""
        assert self.prm is not None
        algorithm, prm = self.settings.algorithm, self.prm
        if reference is None or prm.reference is not self.reference:
            reference = self._no_grad_logprobs(prm.reference, batch)
        before = prm.config.model.update == "before"
        metrics = prm.train(batch, minis, self._local_rows, reference) if before else {}
        process = implicit_process_rewards(self._no_grad_logprobs(prm.model, batch), reference,
                                           batch.response_mask, prm.beta)
        if not before:
            metrics = prm.train(batch, minis, self._local_rows, reference)
        advantages, _ = prime_advantages(process, batch.rewards, batch.response_mask,
                                         batch.group_ids, algorithm.reward_dpo_coef,
                                         algorithm.reward_gt_coef)
        metrics["prm/process_reward_mean"] = float(process.sum() / batch.response_mask.sum())
        return advantages, metrics

    def _local_rows(self, rows: torch.Tensor) -> tuple[list[torch.Tensor], int]:
        """This rank's rows of a mini-batch in micro-batches; every rank gets as many."""
        micro = self.settings.actor.ppo_micro_batch_size_per_gpu
        most = math.ceil(len(rows) / self.world)
        count = math.ceil(most / micro)
        return _chunks(rows[self.rank::self.world], count), count

    @torch.no_grad()
    def _no_grad_logprobs(self, model: nn.Module, batch: TrainBatch) -> torch.Tensor:
        """Log-probs of every row of the batch, in its own grid: each rank computes the rows
        it trains on (an empty chunk still runs a pass for FSDP's collectives, and is not
        kept), and the ranks sum them."""
        out = torch.zeros_like(batch.behavior_logprobs)
        for mini in self.mini_batches(batch):
            chunks, _ = self._local_rows(mini)
            for chunk in chunks:
                part = batch.select(chunk if len(chunk) else mini[:1])
                logprobs, _ = forward_logprobs(model, part, self.settings.temperature, False)
                if len(chunk):
                    out[chunk, :logprobs.shape[1]] = logprobs
        if dist.is_initialized() and self.world > 1:
            dist.all_reduce(out, group=self.group)
        return out

    def _accumulate(self, batch: TrainBatch, mini: torch.Tensor, advantages: torch.Tensor,
                    proximal: torch.Tensor | None, reference: torch.Tensor | None,
                    correction: Correction | None, current_version: float, version: int,
                    sums: _Sums) -> None:
        actor = self.settings.actor
        mini_mask = batch.response_mask[mini]
        totals = dict(num_tokens=float(mini_mask.sum()), num_seqs=float(len(mini)),
                      horizon=self.settings.horizon)
        chunks, _ = self._local_rows(mini)
        for chunk in chunks:
            weight = 1.0 if len(chunk) else 0.0  # an empty chunk still joins the collectives
            rows = chunk if len(chunk) else mini[:1]
            part = batch.select(rows)
            width = part.response_mask.shape[1]
            logprobs, entropy = forward_logprobs(self.model, part, self.settings.temperature,
                                                 with_entropy=True)
            prox = self._proximal(logprobs, part, proximal, rows, current_version, version)
            if correction is None:
                part_correction = off_policy_correction(prox, part.behavior_logprobs,
                                                        part.response_mask, self.correction)
            else:
                part_correction = Correction(weight=correction.weight[rows, :width],
                                             mask=correction.mask[rows, :width],
                                             log_ratio=correction.log_ratio[rows, :width])
            terms = policy_loss(logprobs, prox, advantages[rows, :width], part.response_mask,
                                self.loss_params)
            mask = part.response_mask * weight
            kept = part_correction.mask * weight
            # rejected tokens add zero loss but stay in the denominators (aggregated under
            # the response mask), so rejection never up-weights the tokens that remain
            weighted = (terms.loss * part_correction.weight * part_correction.mask
                        * part.sample_weights[:, None])
            loss = aggregate_loss(weighted, mask, actor.loss_agg_mode, **totals)
            if actor.entropy_coeff:
                loss = loss - actor.entropy_coeff * aggregate_loss(entropy, mask,
                                                                   actor.loss_agg_mode, **totals)
            if actor.use_kl_loss:
                kl = kl_penalty(logprobs, reference[rows, :width], actor.kl_loss_type)
                loss = loss + actor.kl_loss_coef * aggregate_loss(kl, mask, actor.loss_agg_mode,
                                                                  **totals)
                sums.add("actor/kl_sum", (kl.detach() * mask).sum())
            (loss * self.world).backward()
            with torch.no_grad():
                self._diagnostics(terms, part_correction, entropy, prox, part, mask, kept, sums)
                sums.add("loss", loss.detach())

    def _proximal(self, logprobs: torch.Tensor, part: TrainBatch, proximal: torch.Tensor | None,
                  rows: torch.Tensor, current_version: float, version: int) -> torch.Tensor:
        """Proximal log-probs of ``part``: precomputed, exact (first update) or A-3PO."""
        if proximal is not None:
            return proximal[rows, :logprobs.shape[1]]
        if current_version == version:  # nothing has been updated yet in this step
            return logprobs.detach()
        return a3po_proximal_logprobs(part.behavior_logprobs, logprobs.detach(), part.versions,
                                      proximal_version=version,
                                      current_version=current_version,
                                      response_mask=part.response_mask)

    def _diagnostics(self, terms: PolicyLossTerms, correction: Correction,
                     entropy: torch.Tensor, proximal: torch.Tensor, part: TrainBatch,
                     mask: torch.Tensor, kept: torch.Tensor, sums: _Sums) -> None:
        sums.add("tokens", mask.sum())
        sums.add("actor/pg_loss_sum", (terms.loss.detach() * mask).sum())
        sums.add("actor/entropy_sum", (entropy.detach() * mask).sum())
        sums.add("actor/clip_frac_sum", (terms.clipped.float() * mask).sum())
        sums.add("actor/approx_kl_sum", (terms.approx_kl * mask).sum())
        sums.add("actor/ratio_mean_sum", (terms.ratio * mask).sum())
        raw_weight = torch.exp(correction.log_ratio.clamp(-20.0, 20.0))  # proximal / behavior
        sums.add("actor/importance_weight_mean_sum", (raw_weight * mask).sum())
        sums.add("actor/is_weight_applied_mean_sum", (correction.weight * kept).sum())
        sums.add("actor/rejected_frac_sum", (mask - kept).sum())
        proximal_gap = (proximal - part.behavior_logprobs).abs()
        sums.add("actor/behav_prox_logprob_gap_sum", (proximal_gap * mask).sum())
        on_response = raw_weight[mask > 0]
        if on_response.numel():
            sums.max("actor/importance_weight_max", float(on_response.max()))

    def _optimizer_step(self, sums: _Sums) -> float:
        norm = clipped_step(self.model, self.optimizer, self.settings.actor.grad_clip)
        if not math.isfinite(norm):
            sums.add("skipped", 1.0)  # the step was not taken
        return norm
