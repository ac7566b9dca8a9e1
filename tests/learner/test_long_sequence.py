"""One 8,192-token pass at Qwen's 151,936-token vocabulary: the learner's log-probs and
entropies equal today's formulas (``token_logprobs``, ``entropy_from_logits`` on whole
logits rows, within 1e-5 in fp32), and the pass, forward and backward, peaks under 1.5 GiB
above what the process held before it.

The model is a random one-layer Qwen2 of hidden size 64 (tied embeddings, 39 MB), so the
vocabulary dominates: whole fp32 logits of the sequence are 4.6 GiB, and even the 2,048
response positions' alone are 1.2 GiB before log-softmax's and softmax's copies. The
reference runs after the measured pass, on the same final hidden states, 256 positions at a
time through the model's own head and today's functions: a log-prob or an entropy depends
only on its own row of logits, so slicing positions leaves every value as the unsliced
computation has it. The pass runs in a process of its own, whose peak resident memory is
reset before the pass (``/proc/self/clear_refs``) and read after it (``VmHWM``); its address
space is capped a few GiB above the start, so an implementation that materialises the
logits fails with an allocation error instead of taking the shared machine's memory.
"""

from __future__ import annotations

import resource
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

from relay.algorithms.logprobs import entropy_from_logits, token_logprobs
from relay.learner.batch import TrainBatch
from relay.learner.model import forward_logprobs

from ..conftest import exit_worker

VOCAB = 151_936
LENGTH = 8_192
RESPONSE = 2_048
PEAK_LIMIT = 1.5 * 2**30
ADDRESS_HEADROOM = 4 * 2**30


def status_bytes(field: str) -> int:
    """This process's ``field`` of /proc/self/status (VmRSS, VmHWM, VmSize) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def long_batch() -> TrainBatch:
    """One row of ``LENGTH`` random tokens whose last ``RESPONSE`` are the response."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (1, LENGTH), generator=generator)
    response_mask = torch.zeros(1, LENGTH - 1)
    response_mask[0, LENGTH - 1 - RESPONSE:] = 1.0
    return TrainBatch(input_ids=ids, attention_mask=torch.ones(1, LENGTH, dtype=torch.long),
                      response_mask=response_mask, behavior_logprobs=torch.zeros(1, LENGTH - 1),
                      versions=torch.zeros(1, LENGTH - 1, dtype=torch.long),
                      rewards=torch.zeros(1), group_ids=torch.zeros(1, dtype=torch.long),
                      response_lengths=torch.tensor([RESPONSE]), sample_weights=torch.ones(1),
                      baseline_rewards=torch.full((1,), float("nan")))


def todays_values(model: Qwen2ForCausalLM, batch: TrainBatch, temperature: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies (B, L - 1) of the response as the learner computed them
    before chunking: the model's logits rows through ``token_logprobs`` and
    ``entropy_from_logits``, 256 positions at a time (module docstring); 0 elsewhere."""
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=batch.input_ids).last_hidden_state[0, :-1]
        logprobs, entropy = torch.zeros(2, LENGTH - 1)
        for start in range(LENGTH - 1 - RESPONSE, LENGTH - 1, 256):
            rows = slice(start, start + 256)
            logits = model.lm_head(hidden[rows])  # (256, V)
            logprobs[rows] = token_logprobs(logits, batch.input_ids[0, 1:][rows], temperature)
            entropy[rows] = entropy_from_logits(logits, temperature)
    return logprobs[None], entropy[None]


def long_pass_worker(rank: int, out_file: str) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=LENGTH, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    batch = long_batch()
    address_space = status_bytes("VmSize") + ADDRESS_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_bytes("VmRSS")
    logprobs, entropy = forward_logprobs(model, batch, 0.7, with_entropy=True)
    ((logprobs + entropy) * batch.response_mask).sum().backward()
    peak = status_bytes("VmHWM") - before
    grad = model.lm_head.weight.grad.detach().clone()
    expected = todays_values(model, batch, 0.7)
    torch.save({"peak": peak, "logprobs": logprobs.detach(), "entropy": entropy.detach(),
                "expected": expected, "grad": grad}, out_file)
    exit_worker()


def test_an_8k_token_pass_at_qwen_vocabulary_stays_under_1_5_gib(tmp_path: Path) -> None:
    out = tmp_path / "long.pt"
    mp.start_processes(long_pass_worker, args=(str(out),), nprocs=1, start_method="spawn")
    result = torch.load(out)
    expected_logprobs, expected_entropy = result["expected"]
    torch.testing.assert_close(result["logprobs"], expected_logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(result["entropy"], expected_entropy, atol=1e-5, rtol=1e-5)
    assert result["grad"].abs().sum() > 0  # the backward reached the head
    assert result["peak"] < PEAK_LIMIT, f"peak {result['peak'] / 2**30:.2f} GiB above the start"
