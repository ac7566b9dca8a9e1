"""One learner step: log-probs, advantages, the staleness-corrected loss, optimizer steps.

The batch is the whole global batch on every rank (rank 0 broadcast it); each
data-parallel rank trains on rows ``rank::world`` of every mini-batch (under Ulysses
sequence parallelism the ranks of an SP group split those rows' tokens: ``relay.learner.ulysses``).
Losses are sums divided by counts over the whole mini-batch (``relay.algorithms.aggregation``),
multiplied by the world size because FSDP averages gradients across ranks: so the update
does not depend on the number of ranks, SP groups or micro-batches. The batch is cut by
``relay.learner.micro_batches`` (as for the critic and the PRM): every rank runs the same number
of forward/backward passes (FSDP's collectives need it), and a rank with fewer rows pads
with a zero-weighted stand-in pass.

Per token, the loss is the configured surrogate (``relay.algorithms.policy_loss``, ratio current /
proximal) under the off-policy correction (``relay.algorithms.off_policy``: importance weight
proximal / behavior, truncated or AReaL's token mask, and rejection masks); the loss mode
receives the rejection mask as its response mask and the weights, so a rejected token also
leaves GSPO's sequence ratio and GMPO's geometric mean. Tokens a correction rejects
contribute zero policy, entropy and KL-loss terms. A per-sequence mean (seq-mean-token-mean,
and so gspo's, sapo's and geo_mean's objectives) is over the sequence's kept tokens, as
verl's rejection (which rewrites the response mask) gives it: half a sequence rejected
leaves its objective whole, not halved. The batch's counts, token-mean's token count and the
number of sequences B, stay those of the response, as AReaL's decoupled loss keeps them
(verl counts the kept tokens): rejecting never up-weights the tokens or sequences that
remain, and the counts, computed before the micro-batch loop, keep the update independent of
ranks and micro-batches (``relay.algorithms.aggregation``). The policy loss of gspo, sapo and
geo_mean is aggregated per sequence, as verl does
(``relay.algorithms.policy_loss.policy_loss_agg_mode``); ``actor.loss_agg_mode`` aggregates
everything else.

Proximal log-probs are the policy's before this step's first optimizer step. With one
update per step (one epoch, one mini-batch) they equal the detached log-probs of the same
forward pass, which saves a forward pass. Otherwise they are recomputed up front
(``actor.proximal_logprobs = "recompute"``) or, for every update after the first,
interpolated between behavior and current log-probs by version (``"a3po"``), where the
j-th of the step's u updates counts as version ``v + j / u``. KL in the reward and rejection
(``rollout_rs`` or M2PO) need them up front in every case, a3po or not: the rejection mask
enters the advantages, as verl applies it to the response mask before ``compute_advantage``.
Every up-front pass (proximal,
reference, PRIME's PRM) gives each rank the whole batch: each rank computes the rows it
trains on and the ranks sum them, so batch-level quantities (KL in the reward, M2PO's second
moment, PRIME's process rewards) are the same at any number of ranks.

Advantages are computed once per step on the whole batch (``relay.algorithms.advantages``), after
KL in the reward, when on, has added ``-beta * KL(proximal || reference)`` per token, and
over the tokens the rejection kept (whitening, OPO's lengths; ``kept_mask``). ReMax
takes each group's greedy baseline reward from the batch; PRIME trains its implicit PRM
(``relay.learner.implicit_prm``) and adds its token rewards (``relay.algorithms.prime``). With
``gae`` the critic predicts the values first, trains on this step's returns, and for the
first ``trainer.critic_warmup`` steps the actor does not update; each group's mean
|return - value| is its TD-error, the priority of prioritized replay by ``td_error``.
Under prioritized replay each row's policy and value losses are multiplied by its group's
importance weight (``TrainBatch.sample_weights``).

Rows whose advantages are all zero (a GRPO group whose samples all scored the same: often
half the batch) add exactly nothing to the gradient when the loss is proportional to the
advantage and there is no entropy or KL-loss term; with ``actor.skip_zero_advantage`` they
get no forward or backward pass, while still counting in the loss's denominators.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Iterator
from typing import TypeVar

import msgspec
import torch
import torch.distributed as dist
from torch import nn

from relay.algorithms.advantages import (
    AdvantageInputs,
    compute_advantages,
    group_sum,
    token_level_rewards,
)
from relay.algorithms.aggregation import aggregate_loss
from relay.algorithms.kl import kl_penalty, kl_reward_penalty, make_kl_controller
from relay.algorithms.off_policy import Correction, a3po_proximal_logprobs, off_policy_correction
from relay.algorithms.policy_loss import PolicyLossTerms, policy_loss, policy_loss_agg_mode
from relay.algorithms.prime import implicit_process_rewards
from relay.algorithms.registry import policy_loss_mode
from relay.configs.run_schema import (
    ActorConfig,
    AlgorithmConfig,
    DataConfig,
    RefConfig,
    RolloutConfig,
    TrainerConfig,
)
from relay.learner.batch import TrainBatch
from relay.learner.critic import Critic
from relay.learner.deepspeed_engine import ZeroEngine
from relay.learner.implicit_prm import ImplicitPRM
from relay.learner.micro_batches import MicroBatches, MiniBatchTotals, mini_batch_totals
from relay.learner.model import back_to_shards, forward_logprobs
from relay.learner.shared_prompts import unsupported
from relay.learner.ulysses import Parallelism
from relay.learner.optim import clipped_step

logger = logging.getLogger("relay.learner")
T = TypeVar("T")


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


class _Sums:
    """Diagnostics as sums (and maxima) over the step's passes. A tensor is accumulated as
    a float64 tensor on its device, never read back per pass; a Python number stays on the
    host. ``reduced`` all-reduces both kinds on ``device`` (the collectives of the learner's
    device: NCCL on a GPU, gloo on the CPU) and reads them back once: the step's one host
    sync for its diagnostics."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.values: dict[str, torch.Tensor | float] = {}
        self.maxima: dict[str, torch.Tensor | float] = {}

    def add(self, name: str, value: torch.Tensor | float) -> None:
        if torch.is_tensor(value):
            value = value.detach().double()
        self.values[name] = self.values.get(name, 0.0) + value

    def max(self, name: str, value: torch.Tensor | float) -> None:
        if torch.is_tensor(value):
            value = value.detach().double()
        old = self.maxima.get(name)
        if old is None:
            self.maxima[name] = value
        elif torch.is_tensor(old) or torch.is_tensor(value):
            self.maxima[name] = torch.maximum(self._on_device(old), self._on_device(value))
        else:
            self.maxima[name] = max(old, value)

    def reduced(self, group: dist.ProcessGroup | None) -> dict[str, float]:
        """Every sum (over the ranks of ``group``) and maximum, read in one host sync."""
        sums, maxima = self._packed(self.values), self._packed(self.maxima)
        if dist.is_initialized():
            if self.values:
                dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            if self.maxima:
                dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        names = [*sorted(self.values), *sorted(self.maxima)]
        return dict(zip(names, torch.cat([sums, maxima]).tolist()))

    def _on_device(self, value: torch.Tensor | float) -> torch.Tensor:
        if not torch.is_tensor(value):
            return torch.tensor(value, dtype=torch.float64, device=self.device)
        return value if value.device == self.device else value.to(self.device)

    def _packed(self, entries: dict[str, torch.Tensor | float]) -> torch.Tensor:
        """(n,) float64 on ``device``: the entries in name order."""
        if not entries:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        return torch.stack([self._on_device(entries[name]) for name in sorted(entries)])


def with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Each item of ``items`` with whether it is the last one."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True


def compute_device(model: nn.Module) -> torch.device:
    """The device ``model`` computes on: that of its parameters, or for an FSDP2 model that
    of its mesh (under ``actor.fsdp_config.param_offload`` the parameters stay on the CPU
    and are brought to the mesh's device for each pass), this process's current GPU on a
    CUDA mesh (``relay.learner.model.learner_device`` set it), as FSDP2 itself resolves it."""
    param = next(model.parameters())
    mesh = getattr(param, "device_mesh", None)
    if mesh is None or mesh.device_type == "cpu":
        return param.device if mesh is None else torch.device("cpu")
    return torch.device(mesh.device_type,
                        torch.get_device_module(mesh.device_type).current_device())


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """``perf/max_memory_allocated_gb``: the most GiB (2^30 bytes, verl's "gb") torch held
    on ``device`` since the last ``reset_peak_memory`` (the step's peak), on a GPU. Left out
    on the CPU: the process's peak resident memory cannot be reset per step
    (``tools/bench-learner.py`` samples it)."""
    if device.type != "cuda":
        return {}
    return {"perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30}


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for ``peak_memory_gb`` (GPU only)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class Learner:
    """The policy being trained, its optimizer and schedule, and the optional reference.

    It reads its own sections, ``actor``, ``algorithm`` and ``ref``, and from three others:
    ``rollout.temperature`` (log-probs of softmax(logits / T)), ``rollout.response_length``
    (the horizon, the constant of seq-mean-token-sum-norm), ``data.train_batch_size``
    (groups per batch) and ``trainer.critic_warmup`` (the first steps update only the
    critic).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, *, actor: ActorConfig,
                 algorithm: AlgorithmConfig, ref: RefConfig | None = None,
                 rollout: RolloutConfig, data: DataConfig, trainer: TrainerConfig | None = None,
                 reference: nn.Module | None = None, critic: Critic | None = None,
                 prm: ImplicitPRM | None = None, parallelism: Parallelism | None = None,
                 device: torch.device | None = None, zero: ZeroEngine | None = None) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        # actor.strategy = "deepspeed": the engine that forwards, reduces and steps ``model``
        self.zero = zero
        self.policy = zero.policy if zero is not None else model  # what the passes call
        # where every step computes: its batch is moved there first (``step``)
        self.device = device or compute_device(model)
        self.actor, self.algorithm = actor, algorithm
        self.temperature, self.horizon = rollout.temperature, rollout.response_length
        self.critic_warmup = (trainer or TrainerConfig()).critic_warmup
        self.reference, self.critic, self.prm = reference, critic, prm
        parallelism = parallelism or Parallelism()
        self.group, self.sp = parallelism.data_group, parallelism.sequence
        self.steps_done = 0  # learner steps taken, counting the critic's warm-up
        self.micro = MicroBatches(groups_per_mini_batch=actor.ppo_mini_batch_size
                                  or data.train_batch_size,
                                  micro_batch_size=actor.ppo_micro_batch_size_per_gpu,
                                  max_token_len=actor.ppo_max_token_len_per_gpu
                                  if actor.use_dynamic_bsz else None,
                                  share_prompts=actor.share_prompts, group=self.group,
                                  sp=self.sp)
        self.world = self.micro.world  # data-parallel ranks
        ref = (ref or RefConfig()).resolve(actor)  # the reference's passes (RefConfig)
        self.ref_micro = MicroBatches(
            groups_per_mini_batch=self.micro.groups_per_mini_batch,
            micro_batch_size=ref.log_prob_micro_batch_size_per_gpu,
            max_token_len=ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz
            else None, share_prompts=actor.share_prompts, group=self.group, sp=self.sp)
        self.estimator = estimator = algorithm.estimator  # its registry entry
        for part, needed, given in (("critic", estimator.critic, critic),
                                    ("implicit PRM", estimator.prm, prm)):
            if needed and given is None:
                raise ValueError(f"algorithm.adv_estimator = {estimator.name!r} needs the {part}")
        if (actor.use_kl_loss or algorithm.use_kl_in_reward) and reference is None:
            raise ValueError("KL (actor.use_kl_loss or algorithm.use_kl_in_reward) needs the "
                             "frozen reference model")
        self.correction = algorithm.rollout_correction
        self.kl_ctrl = make_kl_controller(algorithm.kl_ctrl) if algorithm.use_kl_in_reward \
            else None
        mode = actor.policy_loss.loss_mode
        self.skips_zero_advantage = (actor.skip_zero_advantage
                                     and policy_loss_mode(mode).zero_advantage_zero_gradient
                                     and not actor.use_kl_loss and actor.entropy_coeff == 0)
        why_not = unsupported(model.config) if actor.share_prompts else None
        if actor.share_prompts and self.sp is not None:
            why_not = "not under Ulysses sequence parallelism (it packs rows without sharing)"
        elif why_not:
            why_not = f"not for this model's {why_not}"
        if why_not and self.micro.rank == 0:
            logger.info("actor.share_prompts: %s; every sample is its own row", why_not)
        self.pg_agg_mode = policy_loss_agg_mode(mode, actor.loss_agg_mode)
        if self.pg_agg_mode != actor.loss_agg_mode and self.micro.rank == 0:
            logger.info("actor.policy_loss.loss_mode = %r: its policy loss is aggregated with "
                        "%s, as verl does; actor.loss_agg_mode = %r aggregates the entropy and "
                        "KL-loss terms", mode, self.pg_agg_mode, actor.loss_agg_mode)

    def full_policy(self) -> contextlib.AbstractContextManager:
        """The policy's full parameters in ``model`` for the block: gathered under ZeRO-3
        (a weight publish, a Hugging Face export); FSDP2's and ZeRO-2's are in place."""
        return self.zero.gathered() if self.zero is not None else contextlib.nullcontext()

    def step(self, batch: TrainBatch, version: int = 0) -> StepResult:
        """One learner step on the global ``batch`` by the policy at ``version``. The batch
        (collated on the host) is moved to the learner's device first, asynchronously from
        pinned memory; on the CPU this moves nothing."""
        actor, algorithm = self.actor, self.algorithm
        batch = batch.to(self.device, non_blocking=True)
        reset_peak_memory(self.device)
        minis = self.micro.mini_batches(batch)
        updates = actor.ppo_epochs * len(minis)
        self.model.train()
        upfront = (updates > 1 and actor.proximal_logprobs == "recompute") \
            or algorithm.use_kl_in_reward or self.correction.rejects
        proximal = self._no_grad_logprobs(self.policy, batch) if upfront else None
        reference = None
        if self.reference is not None:
            with self._reference_pass():
                reference = self._no_grad_logprobs(self.reference, batch, self.ref_micro)
        correction = None
        if proximal is not None:
            correction = off_policy_correction(proximal, batch.behavior_logprobs,
                                               batch.response_mask, self.correction)
        # the rejection mask enters the advantages (verl: before compute_advantage)
        kept = correction.mask if correction is not None and self.correction.rejects else None
        extra: dict[str, float] = {}
        token_rewards = None
        td_errors: list[float] = []
        if self.kl_ctrl is not None:
            token_rewards, sequence_kl = kl_reward_penalty(
                proximal, reference, batch.response_mask, self.kl_ctrl.value,
                algorithm.kl_penalty)
            extra["actor/reward_kl_coef"] = self.kl_ctrl.value
            extra["actor/reward_kl"] = float(sequence_kl.mean())
            self.kl_ctrl.update(extra["actor/reward_kl"], n_steps=batch.rows)
        inputs = AdvantageInputs(rewards=batch.rewards, group_ids=batch.group_ids,
                                 response_mask=batch.response_mask, token_rewards=token_rewards,
                                 baseline_rewards=self._greedy_baselines(batch), kept_mask=kept)
        if self.estimator.critic:  # advantages from the critic's values (gae_advantages)
            old_values = self.critic.values(batch, minis, self.micro)
            advantages, returns = self.estimator.function(
                token_level_rewards(inputs), old_values, batch.response_mask, algorithm.gamma,
                algorithm.lam, kept_mask=kept)
            td_errors = group_td_errors(returns, old_values, batch.response_mask,
                                        batch.group_ids)
            extra.update(self.critic.train(batch, minis, self.micro, old_values, returns,
                                           self.horizon))
            if self.steps_done < self.critic_warmup:
                self.steps_done += 1
                return StepResult({**extra, **self._peak_memory(),
                                   "actor/updates_skipped": float(updates)}, td_errors,
                                  policy_updated=False)
        elif self.estimator.prm:  # from the implicit PRM's token rewards (prime_advantages)
            advantages, extra_prm = self._prime_advantages(batch, minis, reference, kept)
            extra.update(extra_prm)
        else:
            advantages = compute_advantages(
                algorithm.adv_estimator, inputs,
                norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo, gamma=algorithm.gamma)
        sums = _Sums(self.device)
        grad_norms: list[float] = []
        totals = mini_batch_totals(batch, minis)
        for epoch in range(actor.ppo_epochs):
            for index, mini in enumerate(minis):
                if self.zero is None:  # DeepSpeed clears its partitions' gradients itself
                    self.optimizer.zero_grad(set_to_none=True)
                done = epoch * len(minis) + index
                self._accumulate(batch, mini, totals[index], advantages, proximal, reference,
                                 correction, version + done / updates, version, sums)
                grad_norms.append(self._optimizer_step(sums))
        self.scheduler.step()
        for name, value in peak_memory_gb(self.device).items():
            sums.max(name, value)
        stats = sums.reduced(self.group)
        tokens = max(stats.get("tokens", 0.0), 1.0)
        metrics = {name.removesuffix("_sum"): value / tokens for name, value in stats.items()
                   if name.endswith("_sum")}
        metrics.update(extra)
        metrics.update({name: stats[name] for name in peak_memory_gb(self.device)})
        importance_weight_max = stats.get("actor/importance_weight_max", -math.inf)
        metrics.update({
            # -inf: no pass of the step had a response token
            "actor/importance_weight_max": importance_weight_max
            if math.isfinite(importance_weight_max) else 0.0,
            "actor/grad_norm": sum(grad_norms) / updates,
            "actor/lr": self.scheduler.get_last_lr()[0],
            "actor/updates_skipped": stats.get("skipped", 0.0) / self.world,
            "actor/loss": stats.get("loss", 0.0) / updates,
            "actor/tokens": stats.get("tokens", 0.0) / actor.ppo_epochs,
            "actor/zero_advantage_rows_skipped": stats.get("rows_skipped", 0.0) / updates,
        })
        self.steps_done += 1
        return StepResult(metrics, td_errors)

    # -- internals ----------------------------------------------------------------------

    def _peak_memory(self) -> dict[str, float]:
        """``peak_memory_gb``, the largest over the data-parallel ranks."""
        sums = _Sums(self.device)
        for name, value in peak_memory_gb(self.device).items():
            sums.max(name, value)
        return sums.reduced(self.group) if sums.maxima else {}

    def _greedy_baselines(self, batch: TrainBatch) -> torch.Tensor | None:
        """ReMax's baselines (B,), or None for the other estimators."""
        if not self.estimator.greedy_baseline:
            return None
        if bool(batch.baseline_rewards.isnan().any()):
            raise ValueError("remax needs every group's greedy baseline reward "
                             "(RolloutGroup.baseline_reward); some groups came without one")
        return batch.baseline_rewards

    def _prime_advantages(self, batch: TrainBatch, minis: list[torch.Tensor],
                          reference: torch.Tensor | None, kept: torch.Tensor | None
                          ) -> tuple[torch.Tensor, dict[str, float]]:
        """PRIME: train the implicit PRM (before or after scoring), score the batch's tokens,
        combine with the outcome rewards (``relay.algorithms.prime``). ``reference``: the policy's
        reference log-probs, reused when the PRM shares that reference model; ``kept``: the
        rejection's mask, or None."""
        assert self.prm is not None
        algorithm, prm = self.algorithm, self.prm
        if reference is None or prm.reference is not self.reference:
            reference = self._no_grad_logprobs(prm.reference, batch)
        before = prm.config.model.update == "before"
        metrics = prm.train(batch, minis, self.micro, reference) if before else {}
        process = implicit_process_rewards(self._no_grad_logprobs(prm.model, batch), reference,
                                           batch.response_mask, prm.beta)
        if not before:
            metrics = prm.train(batch, minis, self.micro, reference)
        advantages, _ = self.estimator.function(process, batch.rewards, batch.response_mask,
                                                batch.group_ids, algorithm.reward_dpo_coef,
                                                algorithm.reward_gt_coef, kept_mask=kept)
        metrics["prm/process_reward_mean"] = float(process.sum() / batch.response_mask.sum())
        return advantages, metrics

    def _reference_pass(self) -> contextlib.AbstractContextManager:
        """Where the reference's passes run: a LoRA policy that is its own reference
        (``relay.learner.lora``) with its adapters disabled, y = W x; any other reference
        as it is."""
        if self.reference is self.model:
            return self.model.disable_adapter()
        return contextlib.nullcontext()

    @torch.no_grad()
    def _no_grad_logprobs(self, model: nn.Module, batch: TrainBatch,
                          micro: MicroBatches | None = None) -> torch.Tensor:
        """Log-probs of every row of the batch, in its own grid: each rank computes the rows
        it trains on (a stand-in pass is not kept), and the ranks sum them; the model goes
        back to its shards (``back_to_shards``). ``micro`` cuts the passes (default: the
        actor's cut; the reference's is ``ref_micro``)."""
        micro = micro or self.micro
        out = torch.zeros_like(batch.behavior_logprobs)
        for mini in micro.mini_batches(batch):
            for each in micro.passes(batch, mini):
                logprobs, _ = forward_logprobs(model, each.part, self.temperature, False,
                                               micro.share_prompts, self.sp)
                if each.owned():
                    out[each.rows, :logprobs.shape[1]] = logprobs
        back_to_shards(model)
        if dist.is_initialized() and self.world > 1:
            dist.all_reduce(out, group=self.group)
        return out

    def _accumulate(self, batch: TrainBatch, mini: torch.Tensor, mini_totals: MiniBatchTotals,
                    advantages: torch.Tensor, proximal: torch.Tensor | None,
                    reference: torch.Tensor | None, correction: Correction | None,
                    current_version: float, version: int, sums: _Sums) -> None:
        actor = self.actor
        totals = dict(num_tokens=mini_totals.tokens, num_seqs=mini_totals.sequences,
                      horizon=self.horizon)
        trained = self._rows_with_advantage(batch, mini, advantages)
        sums.add("rows_skipped", float(len(mini) - len(trained)) / self.world)
        for each, last in with_last(self.micro.passes(batch, trained)):
            rows, part, weight = each.rows, each.part, each.weight
            width = part.response_mask.shape[1]
            logprobs, entropy = forward_logprobs(self.policy, part, self.temperature,
                                                 with_entropy=True,
                                                 share_prompts=self.micro.share_prompts,
                                                 sp=self.sp)
            prox = self._proximal(logprobs, part, proximal, rows, current_version, version)
            if correction is None:
                part_correction = off_policy_correction(prox, part.behavior_logprobs,
                                                        part.response_mask, self.correction)
            else:
                part_correction = Correction(weight=correction.weight[rows, :width],
                                             mask=correction.mask[rows, :width],
                                             log_ratio=correction.log_ratio[rows, :width])
            terms = policy_loss(logprobs, prox, advantages[rows, :width], part_correction.mask,
                                actor.policy_loss, clip_ratio_low=actor.clip_ratio_low,
                                clip_ratio_high=actor.clip_ratio_high,
                                clip_ratio_c=actor.clip_ratio_c,
                                importance_weights=part_correction.weight)
            mask = part.response_mask * weight
            kept = part_correction.mask * weight
            # summed over the kept tokens, each sequence's mean over its kept tokens, but
            # divided by the response's token and sequence counts (``totals``): rejection
            # never up-weights the tokens or sequences that remain
            weighted = terms.loss * part.sample_weights[:, None]
            loss = aggregate_loss(weighted, kept, self.pg_agg_mode, **totals)
            if actor.entropy_coeff:
                loss = loss - actor.entropy_coeff * aggregate_loss(
                    entropy, kept, actor.loss_agg_mode, **totals)
            if actor.use_kl_loss:
                kl = kl_penalty(logprobs, reference[rows, :width], actor.kl_loss_type)
                loss = loss + actor.kl_loss_coef * aggregate_loss(
                    kl, kept, actor.loss_agg_mode, **totals)
                sums.add("actor/kl_sum", (kl.detach() * mask).sum())
            if self.zero is not None:
                self.zero.backward(loss * self.micro.grad_scale, last=last)
            else:
                (loss * self.micro.grad_scale).backward()
            with torch.no_grad():
                self._diagnostics(terms, part_correction, entropy, prox, part, mask, kept, sums)
                sums.add("loss", loss.detach())

    def _rows_with_advantage(self, batch: TrainBatch, mini: torch.Tensor,
                             advantages: torch.Tensor) -> torch.Tensor:
        """The rows of ``mini`` to run passes over: all of them, or (``skips_zero_advantage``)
        those with a nonzero advantage on a response token. When none has one, all of them,
        so the optimizer still steps on a zero gradient, exactly as without skipping."""
        if not self.skips_zero_advantage:
            return mini
        signal = ((advantages[mini] != 0) & (batch.response_mask[mini] > 0)).any(-1)
        trained = mini[signal]
        return trained if len(trained) else mini

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
        # the largest on the response (-inf for a pass without response tokens)
        sums.max("actor/importance_weight_max",
                 torch.where(mask > 0, raw_weight, -math.inf).max())

    def _optimizer_step(self, sums: _Sums) -> float:
        if self.zero is not None:  # clips to actor.grad_clip; skips a non-finite norm
            norm = self.zero.step()
        else:
            norm = clipped_step(self.model, self.optimizer, self.actor.grad_clip,
                                offload_state=self.actor.fsdp_config.optimizer_offload,
                                device=self.device)
        if not math.isfinite(norm):
            sums.add("skipped", 1.0)  # the step was not taken
        return norm
