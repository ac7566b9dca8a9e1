"""Check B/reward-model: a discriminative reward model scores on the device as on the CPU.

The check's random Qwen2 becomes a ``Qwen2ForSequenceClassification`` with one label (its
weights, plus a random ``score`` head), saved beside it, and ``relay.generators.reward_model``
loads it as a run's ``reward_model.model.path`` would be: once on the CPU in fp32 (the
reference) and once on the device in the check's dtype. Both score the same sequences of
mixed lengths in micro-batches of ``MICRO_BATCH`` (right-padded, the score at each one's
last token); the device's scores must be within ``FP32_TOL`` (fp32) or ``BF16_TOL`` times
the largest score's magnitude (bf16) of the CPU's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gpucheck.report import CheckResult, bounded

MICRO_BATCH = 3
FP32_TOL = 1e-4
BF16_TOL = 5e-2


def save_reward_model(model_dir: Path, folder: Path) -> Path:
    """The causal LM at ``model_dir`` as a one-label sequence classifier in ``folder``."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir, num_labels=1)
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, config=config,
                                                               dtype=torch.float32)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
    return folder


def sequences(vocab: int, count: int = 7, seed: int = 0) -> list[list[int]]:
    """``count`` token sequences of 5 to 40 tokens (ids 3 and up: no special tokens)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 41, (count,), generator=generator).tolist()
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def reward_model_check(model_dir: Path, device: torch.device, dtype: str) -> CheckResult:
    """``B/reward-model:<dtype>`` (module docstring)."""
    from relay.generators.reward_model import load_reward_model, score_sequences

    folder = save_reward_model(model_dir, model_dir.parent / "reward-model")
    reference_model = load_reward_model(str(folder), dtype="float32", device="cpu")
    texts = sequences(reference_model.config.vocab_size)
    pad = reference_model.config.pad_token_id or 0
    reference = torch.tensor(score_sequences(reference_model, texts, micro_batch_size=MICRO_BATCH,
                                             pad_id=pad))
    on_device = load_reward_model(str(folder), dtype=dtype, device=str(device))
    where = {str(p.device) for p in on_device.parameters()}
    scores = torch.tensor(score_sequences(on_device, texts, micro_batch_size=MICRO_BATCH,
                                          pad_id=pad))
    error = float((scores - reference).abs().max())
    limit = FP32_TOL if dtype == "float32" else BF16_TOL * max(1.0, float(reference.abs().max()))
    problems: list[str] = []
    bounded("score_err", error, limit, problems)
    if where != {str(device)}:
        problems.append(f"the reward model's parameters are on {sorted(where)}, not {device}")
    if not bool(torch.isfinite(scores).all()):
        problems.append("a score is not finite")
    return CheckResult(name=f"B/reward-model:{dtype}", passed=not problems,
                       numbers={"score_err": error, "sequences": len(texts)},
                       error="; ".join(problems) or None)
