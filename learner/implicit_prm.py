"""PRIME's implicit process reward model, trained online by the learner
(``relay.algorithms.prime``).

A causal LM pi_phi, loaded like the policy (from ``reward_model.model.path`` or the policy
checkpoint) and FSDP2-sharded, scored against pi_ref, a frozen copy of the checkpoint it
started from (the policy's reference model when that is the same checkpoint). Each step it
learns from the batch's outcome labels (the verifier's rewards, in [0, 1]) with the
cross-entropy of its sequence-level implicit reward, over the actor's mini-batches and
on each rank's rows, as the critic does; its token-level rewards
beta * (log pi_phi - log pi_ref) then enter PRIME's advantages. With
``reward_model.model.update = "before"`` (verl's default) the step's scores come from the
PRM after it trained on the batch; with ``"after"``, from the PRM before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from relay.algorithms.prime import implicit_prm_loss
from relay.configs.run_schema import RewardModelConfig
from relay.learner.batch import TrainBatch
from relay.learner.micro_batches import MicroBatches
from relay.learner.model import forward_logprobs
from relay.learner.optim import build_optimizer, build_scheduler, clipped_step


class ImplicitPRM:
    """The PRM, its frozen reference, its optimizer and schedule, and its training step."""

    def __init__(self, model: nn.Module, reference: nn.Module, config: RewardModelConfig,
                 total_steps: int, temperature: float) -> None:
        self.model, self.reference, self.config = model, reference, config
        self.temperature = temperature
        self.optimizer = build_optimizer(model, config.model.optim)
        self.scheduler = build_scheduler(self.optimizer, total_steps=total_steps,
                                         optim=config.model.optim)

    @property
    def beta(self) -> float:
        return self.config.model.beta_train

    def train(self, batch: TrainBatch, minis: list[torch.Tensor], micro: MicroBatches,
              reference_logprobs: torch.Tensor) -> dict[str, float]:
        """One pass of CE updates on the batch's rewards as labels; rank-reduced metrics.

        ``reference_logprobs`` (B, T): pi_ref's log-probs of the batch.
        """
        self.model.train()
        # loss sum, right-side count: on the batch's device, where they are all-reduced
        # (NCCL on a GPU) with the sequences counted on the host, and read once at the end
        sums = torch.zeros(2, dtype=torch.float64, device=batch.response_mask.device)
        sequences = 0.0
        grad_norms: list[float] = []
        for mini in minis:
            self.optimizer.zero_grad(set_to_none=True)
            for each in micro.passes(batch, mini):
                rows, part, weight = each.rows, each.part, each.weight
                width = part.response_mask.shape[1]
                logprobs, _ = forward_logprobs(self.model, part, self.temperature, False,
                                               micro.share_prompts, micro.sp)
                reference = reference_logprobs[rows, :width]
                per_sequence = implicit_prm_loss(logprobs, reference, part.response_mask,
                                                 part.rewards, self.beta) * weight
                (per_sequence.sum() / len(mini) * micro.grad_scale).backward()
                with torch.no_grad():
                    implicit = ((logprobs - reference) * part.response_mask).sum(-1)
                    right = ((implicit > 0) == (part.rewards > 0.5)).float() * weight
                    sums += torch.stack([per_sequence.sum(), right.sum()]).double()
                sequences += weight * len(rows)
            grad_norms.append(clipped_step(self.model, self.optimizer, self.config.grad_clip))
        self.scheduler.step()
        sums = torch.cat([sums, sums.new_tensor([sequences])])
        if dist.is_initialized():
            dist.all_reduce(sums, group=micro.group)
        loss, right, sequences = sums.tolist()
        sequences = max(sequences, 1.0)
        return {"prm/loss": loss / sequences,
                "prm/accuracy": right / sequences,
                "prm/grad_norm": sum(grad_norms) / len(grad_norms),
                "prm/lr": self.scheduler.get_last_lr()[0]}
