"""A discriminative reward model (verl's ``reward_model.enable``), scoring inside a generator.

The model is loaded with transformers from ``reward_model.model.path``; three layouts are
accepted:

- ``*ForSequenceClassification`` with ``num_labels = 1`` and its head named ``score`` (what
  transformers' decoder models use: Llama, Qwen2, Mistral, Gemma, ...; Skywork's and most
  open reward models);
- ``*ForTokenClassification`` with ``num_labels = 1`` (verl's own ``RewardModelWorker``
  loads this class; ``relay export --critic`` writes Relay's critic so);
- a ``*ForCausalLM`` folder whose safetensors also hold TRL's value head
  (``v_head.summary.weight`` (1, H) and ``.bias``: ``AutoModelForCausalLMWithValueHead``),
  read as the base model plus that head (``ValueHeadModel``).

The score of a sequence is the head's logit at its last token (the last non-pad token of
prompt + response), as verl takes it:

    score = head(h_T)[0],   h = base_model(prompt_ids + response_ids),  T = last index

Sequences are right-padded into micro-batches of ``micro_batch_size_per_gpu``, sorted by
length; with causal attention a token's hidden state never sees the padding after it, so
a score does not depend on its batch. ``max_length`` > 0 cuts longer sequences on the
right (verl's ``truncation = "right"``), keeping their first ``max_length`` tokens.

What the model reads (verl's ``reward_model.model.input_tokenizer``): empty, the policy's
own token ids (prompt then response: the reward model must share the policy's
vocabulary); set, the chat re-rendered with the reward model's tokenizer and chat
template: the prompt's messages plus ``{"role": "assistant", "content": response}``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors import safe_open
from transformers import (AutoConfig, AutoModel, AutoModelForSequenceClassification,
                          AutoModelForTokenClassification, AutoTokenizer)

from relay.algorithms.rewards.result import RewardResult
from relay.configs.run_schema import RewardCombine, RewardModelConfig

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RewardModelError(ValueError):
    """``reward_model.model.path`` is not a reward model Relay can score with; says why."""


def load_reward_model(path: str, *, dtype: str = "float32", device: str = "cpu",
                      trust_remote_code: bool = False) -> torch.nn.Module:
    """The reward model at ``path``, in eval mode on ``device``; ``RewardModelError`` for a
    layout other than the three accepted (module docstring) or ``num_labels != 1``."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    architectures = list(getattr(config, "architectures", None) or [])
    kind = next((a for a in architectures
                 if a.endswith(("ForSequenceClassification", "ForTokenClassification"))), None)
    if kind is None:
        head = value_head_tensors(path)
        if head and any(a.endswith("ForCausalLM") for a in architectures):
            body = AutoModel.from_pretrained(path, dtype=DTYPES[dtype],
                                             trust_remote_code=trust_remote_code)
            return ValueHeadModel(body, head).to(device=device, dtype=DTYPES[dtype]).eval()
        raise RewardModelError(
            f"reward_model.model.path = {path}: architectures {architectures or 'unset'} is not "
            "a *ForSequenceClassification or *ForTokenClassification model, nor a causal LM "
            f"with TRL's value head ({VALUE_HEAD}weight / bias in its safetensors)")
    if config.num_labels != 1:
        raise RewardModelError(f"reward_model.model.path = {path}: num_labels = "
                               f"{config.num_labels}; a reward model has one output (1)")
    auto = (AutoModelForSequenceClassification if kind.endswith("ForSequenceClassification")
            else AutoModelForTokenClassification)
    model = auto.from_pretrained(path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    if auto is AutoModelForSequenceClassification and not isinstance(
            getattr(model, "score", None), torch.nn.Module):
        raise RewardModelError(f"reward_model.model.path = {path}: {kind} has no 'score' head "
                               "(the name transformers' decoder models give it)")
    return model.to(device).eval()


VALUE_HEAD = "v_head.summary."  # TRL's AutoModelForCausalLMWithValueHead


def value_head_tensors(path: str) -> dict[str, torch.Tensor]:
    """TRL's value head (``weight`` (1, H), ``bias`` (1,)) from the ``*.safetensors`` files
    of the folder ``path``; empty when there is none."""
    head: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if name.startswith(VALUE_HEAD):
                    head[name.removeprefix(VALUE_HEAD)] = tensors.get_tensor(name)
    return head


class ValueHeadModel(torch.nn.Module):
    """A causal LM's body with TRL's value head: ``v(h_t) = W h_t + b`` at every token."""

    def __init__(self, body: torch.nn.Module, head: dict[str, torch.Tensor]) -> None:
        super().__init__()
        weight = head.get("weight")
        if weight is None or weight.dim() != 2 or weight.shape[0] != 1:
            raise RewardModelError(f"{VALUE_HEAD}weight must be (1, hidden), got "
                                   f"{None if weight is None else tuple(weight.shape)}")
        self.body = body
        self.v_head = torch.nn.Linear(weight.shape[1], 1, bias="bias" in head)
        self.v_head.load_state_dict(head)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.v_head(hidden)[..., 0]


@torch.no_grad()
def token_logits(model: torch.nn.Module, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor) -> torch.Tensor:
    """The head's logit at every position, ``[batch, length]``."""
    if isinstance(model, ValueHeadModel):
        return model(input_ids, attention_mask)
    if type(model).__name__.endswith("ForSequenceClassification"):
        out = model.base_model(input_ids=input_ids, attention_mask=attention_mask)
        return model.score(out.last_hidden_state)[..., 0]
    return model(input_ids=input_ids, attention_mask=attention_mask).logits[..., 0]


@torch.no_grad()
def score_sequences(model: torch.nn.Module, sequences: Sequence[Sequence[int]], *,
                    micro_batch_size: int, pad_id: int, max_length: int = 0) -> list[float]:
    """The score of each token sequence (module docstring), in the order given, as floats."""
    if any(len(seq) == 0 for seq in sequences):
        raise ValueError("cannot score an empty sequence")
    cut = [list(seq)[:max_length] if max_length > 0 else list(seq) for seq in sequences]
    order = sorted(range(len(cut)), key=lambda i: len(cut[i]))
    device = next(model.parameters()).device
    scores = [0.0] * len(cut)
    for start in range(0, len(order), micro_batch_size):
        chunk = order[start:start + micro_batch_size]
        width = max(len(cut[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, :len(cut[i])] = torch.tensor(cut[i], dtype=torch.long)
            mask[row, :len(cut[i])] = 1
        logits = token_logits(model, ids.to(device), mask.to(device))
        last = mask.sum(dim=1).to(device) - 1
        picked = logits[torch.arange(len(chunk), device=device), last].float().cpu()
        for row, i in enumerate(chunk):
            scores[i] = float(picked[row])
    return scores


class RewardModelScorer:
    """``reward_model``'s discriminative model, loaded on ``device`` (the generator's,
    unless ``reward_model.device`` names another).

    ``score(messages, prompt_ids, responses, texts)``: one float per response of one prompt.
    """

    def __init__(self, config: RewardModelConfig, device: str) -> None:
        if not config.enable:
            raise ValueError("RewardModelScorer needs reward_model.enable = true")
        path = config.model.path
        if not path:
            raise RewardModelError("reward_model.enable = true needs reward_model.model.path")
        self.config = config
        self.device = config.device or device
        self.model = load_reward_model(path, dtype=config.dtype, device=self.device,
                                       trust_remote_code=config.model.trust_remote_code)
        self.retemplate = bool(config.model.input_tokenizer)
        self.tokenizer = AutoTokenizer.from_pretrained(
            path, trust_remote_code=config.model.trust_remote_code)
        if self.retemplate and not getattr(self.tokenizer, "chat_template", None):
            raise RewardModelError(
                f"reward_model.model.path = {path}: its tokenizer has no chat template, so the "
                "chat cannot be re-rendered for it (reward_model.model.input_tokenizer is set); "
                "add one, or leave input_tokenizer empty to score the policy's tokens")
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0  # masked out: any id works

    def rendered(self, messages: list[dict[str, Any]], response: str) -> list[int]:
        """The chat with the response as the assistant's turn, in the reward model's
        template and tokens."""
        text = self.tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": response}], tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def score(self, messages: list[dict[str, Any]], prompt_ids: Sequence[int],
              responses: Sequence[Sequence[int]], texts: Sequence[str]) -> list[float]:
        """The reward model's score of each response (``responses``: the policy's token
        ids; ``texts``: the same responses decoded) to the prompt."""
        if self.retemplate:
            sequences = [self.rendered(messages, text) for text in texts]
        else:
            sequences = [[*prompt_ids, *response] for response in responses]
        return score_sequences(self.model, sequences,
                               micro_batch_size=self.config.micro_batch_size_per_gpu,
                               pad_id=self.pad_id, max_length=self.config.max_length)


def combined(rule: RewardResult, rm_score: float, combine: RewardCombine, *,
             key: str = "rm_score", error: str = "") -> RewardResult:
    """The sample's reward from its rule result and a learned score (``reward_model.combine``):
    ``replace`` -> ``s_rm``, ``add`` -> ``r_rule + s_rm``; both parts kept in ``info``
    (``rule_score``, and ``key``: ``rm_score``, or ``judge_score`` for a judge), the rule's
    error and the learned score's ``error`` kept."""
    score = rm_score if combine == "replace" else rule.score + rm_score
    return msgspec.structs.replace(
        rule, score=score, info={**rule.info, "rule_score": rule.score, key: rm_score},
        error="; ".join(e for e in (rule.error, error) if e))
