"""PPO's critic: a causal-LM body with a scalar value head, trained by the learner.

    V(s_t) = w . h_t + b

where h_t is the body's last hidden state at position t (the prompt and the response up
to token t). The body loads with ``AutoModel`` from the policy checkpoint (or
``critic.model.path``); the head starts at zero, so every first prediction is 0. Values
live on the learner's shifted grid (entry j is the value of the state before token j + 1,
as log-probs are), and are computed by the learner in the very step whose advantages use
them, so a stale value never enters GAE. Training follows the actor's mini-batches with
the clipped value loss (``relay.algorithms.value_loss``), and its passes (under Ulysses sequence
parallelism too: ``relay.learner.ulysses``). With ``critic.model.lora_rank`` > 0 the body is a
peft LoRA model (``relay.learner.lora.wrap_body``): its base weights stay frozen, and the
adapters and the value head train.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoModel, AutoModelForTokenClassification, PretrainedConfig

from relay.algorithms.aggregation import aggregate_loss
from relay.algorithms.value_loss import clipped_value_loss
from relay.configs.run_schema import CriticConfig, CriticModelConfig
from relay.learner.attention import ATTENTION, check_relay_attention
from relay.learner.batch import TrainBatch
from relay.learner.micro_batches import MicroBatches, mini_batch_totals
from relay.learner.model import (
    block_classes,
    enable_activation_checkpointing,
    hf_config,
    load_from_rank0,
    read_on_rank0,
    shard,
    sharding_mesh,
)
from relay.learner.ulysses import gather_tokens, packed_forward
from relay.learner.optim import build_optimizer, build_scheduler, clipped_step


class ValueModel(nn.Module):
    """A transformer body and a linear value head: (B, L) token ids -> (B, L) values."""

    def __init__(self, body: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.body = body
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self) -> PretrainedConfig:
        """The body's transformers config (a ``LlamaConfig``, ``Qwen2Config``, ...): the very
        object its attention layers read ``_attn_implementation`` from, read here by
        ``relay.learner.attention.check_relay_attention`` before a packed forward."""
        return self.body.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **body_inputs: object) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask,
                           use_cache=False, **body_inputs).last_hidden_state
        # A copy, not a view: FSDP2 hooks the output for backward, and views defeat that hook.
        return self.value_head(hidden).squeeze(-1).to(torch.float32, copy=True)


def load_value_model(path: str, *, compute_dtype: torch.dtype, device: torch.device,
                     trust_remote_code: bool = False, gradient_checkpointing: bool = False,
                     mesh: DeviceMesh | None = None,
                     lora: CriticModelConfig | None = None) -> ValueModel:
    """The value model at ``path`` (fp32, attending with ``relay.learner.attention``): a
    trained critic (``read_value_model``), or the body of a causal LM plus a zero value
    head; FSDP2-sharded over ``mesh`` (default: every rank) and loaded from rank 0, as the
    policy is (``relay.learner.model.load_sharded``). ``lora`` (the critic's ``model`` keys,
    ``lora_rank`` > 0): the body gets LoRA adapters before it is sharded."""
    options = dict(dtype=torch.float32, attn_implementation=ATTENTION,
                   trust_remote_code=trust_remote_code)

    def adapted(model: ValueModel) -> ValueModel:
        if lora is not None:
            from relay.learner.lora import wrap_body  # peft: the lora extra
            model.body = wrap_body(model.body, lora)
        return model

    model, full_state = read_on_rank0(
        lambda: adapted(read_value_model(path, options)),
        lambda: adapted(with_value_head(AutoModel.from_config(
            hf_config(path, trust_remote_code), **options))))
    model.config.use_cache = False
    if gradient_checkpointing:
        enable_activation_checkpointing(model.body)
    shard(model, compute_dtype=compute_dtype, blocks=block_classes(model.body),
          mesh=mesh if mesh is not None else sharding_mesh(device))
    load_from_rank0(model, full_state, device)
    return model


def read_value_model(path: str, options: dict) -> ValueModel:
    """The model at ``path`` as a ``ValueModel``. A critic in verl's layout (what ``relay
    export --critic`` and ``relay import-verl`` write: ``*ForTokenClassification`` with one
    label) keeps its trained head, V(s_t) = score(h_t); any other model's body gets a zero
    head."""
    config = hf_config(path, options["trust_remote_code"])
    trained = (config.num_labels == 1 and any(
        name.endswith("ForTokenClassification") for name in config.architectures or ()))
    if not trained:
        return with_value_head(AutoModel.from_pretrained(path, **options))
    critic = AutoModelForTokenClassification.from_pretrained(path, **options)
    model = with_value_head(critic.base_model)
    with torch.no_grad():
        model.value_head.weight.copy_(critic.score.weight)
        if critic.score.bias is not None:
            model.value_head.bias.copy_(critic.score.bias)
    return model


def with_value_head(body: nn.Module) -> ValueModel:
    """``body`` under a value head of its hidden size."""
    return ValueModel(body, body.config.hidden_size)


class Critic:
    """The value model, its optimizer and schedule, and how it predicts and trains."""

    def __init__(self, model: ValueModel, config: CriticConfig, total_steps: int) -> None:
        self.model, self.config = model, config
        self.optimizer = build_optimizer(model, config.optim)
        self.scheduler = build_scheduler(self.optimizer, total_steps=total_steps,
                                         optim=config.optim)

    def _grid_values(self, part: TrainBatch, micro: MicroBatches) -> torch.Tensor:
        """Values (B, L-1) of ``part``'s rows on the learner's grid."""
        if micro.sp is None:
            return self.model(part.input_ids, part.attention_mask)[:, :-1]
        check_relay_attention(self.model)
        packed, values = packed_forward(self.model, part, micro.sp)
        return packed.to_grid(gather_tokens(values, micro.sp))

    @torch.no_grad()
    def values(self, batch: TrainBatch, minis: list[torch.Tensor],
               micro: MicroBatches) -> torch.Tensor:
        """Values (B, L-1) of every row of the batch, identical on every rank."""
        self.model.eval()
        out = torch.zeros_like(batch.behavior_logprobs)
        for mini in minis:
            for each in micro.passes(batch, mini):
                values = self._grid_values(each.part, micro)
                if each.owned():
                    out[each.rows, :values.shape[1]] = values
        if dist.is_initialized():  # each row was filled by one data-parallel rank
            dist.all_reduce(out, group=micro.group)
        return out * batch.response_mask

    def train(self, batch: TrainBatch, minis: list[torch.Tensor], micro: MicroBatches,
              old_values: torch.Tensor, returns: torch.Tensor,
              horizon: int) -> dict[str, float]:
        """Clipped value-loss updates over the actor's mini-batches; rank-reduced metrics."""
        self.model.train()
        # loss*tokens, clipped, error^2, tokens: on the batch's device, where they are
        # all-reduced (NCCL on a GPU) and read once at the end
        sums = torch.zeros(4, dtype=torch.float64, device=batch.response_mask.device)
        grad_norms: list[float] = []
        mini_totals = mini_batch_totals(batch, minis)
        for _epoch in range(self.config.ppo_epochs):
            for mini, mini_total in zip(minis, mini_totals, strict=True):
                self.optimizer.zero_grad(set_to_none=True)
                totals = dict(num_tokens=mini_total.tokens, num_seqs=mini_total.sequences,
                              horizon=horizon)
                for each in micro.passes(batch, mini):
                    rows, part = each.rows, each.part
                    width = part.response_mask.shape[1]
                    predicted = self._grid_values(part, micro)
                    terms = clipped_value_loss(predicted, old_values[rows, :width],
                                               returns[rows, :width], self.config.cliprange_value)
                    mask = part.response_mask * each.weight
                    loss = aggregate_loss(terms.loss * part.sample_weights[:, None], mask,
                                          self.config.loss_agg_mode, **totals)
                    (loss * micro.grad_scale).backward()
                    with torch.no_grad():
                        error = (predicted - returns[rows, :width]) ** 2
                        sums += torch.stack([(terms.loss * mask).sum(),
                                             (terms.clipped.float() * mask).sum(),
                                             (error * mask).sum(), mask.sum()]).double()
                grad_norms.append(clipped_step(self.model, self.optimizer,
                                               self.config.grad_clip))
        self.scheduler.step()
        if dist.is_initialized():
            dist.all_reduce(sums, group=micro.group)
        loss, clipped, squared_error, tokens = sums.tolist()
        tokens = max(tokens, 1.0)
        return {"critic/vf_loss": loss / tokens,
                "critic/vf_clipfrac": clipped / tokens,
                "critic/vf_mse": squared_error / tokens,
                "critic/grad_norm": sum(grad_norms) / len(grad_norms),
                "critic/lr": self.scheduler.get_last_lr()[0]}
