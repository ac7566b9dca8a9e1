"""Ulysses sequence parallelism (learner.ulysses) against the plain padded forward.

- packing: rows packed without padding, labels the next token of the same row, the mask
  block-diagonal and causal, the grid mapping back onto the rows;
- one rank (an SP group of 1): the packed forward gives the padded forward's log-probs;
- SP 2 on a Llama model (2 key/value heads, split), a Qwen2 model (1 key/value head,
  repeated) and a Qwen3 model (per-head q/k norms): the same log-probs, entropies, loss
  and summed gradients as one process without SP, on rows of different lengths (real
  processes, gloo), and with gradient checkpointing;
- DP 2 x SP 2 (4 processes, FSDP2 over all of them) trains two steps to the weights of
  DP 1 x SP 1, for GRPO and for PPO with its critic;
- head counts that do not fit are refused naming the key.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    MistralConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from configs.run_schema import ActorConfig, AlgorithmConfig, OptimConfig
from generators.torch_engine import TorchEngine
from learner.batch import TrainBatch, collate
from learner.model import enable_activation_checkpointing, forward_logprobs
from learner.tiny_model.tokenizer import build_tokenizer
from learner.ulysses import (
    SequenceParallel,
    check_heads,
    learner_parallelism,
    pack_tokens,
)
from learner.weights import gather_full_weights

from ..conftest import exit_worker, free_port
from .test_update import LR, rollouts
from .test_update_algorithms import make_learner


def save_random_qwen2(folder: Path, kv_heads: int = 1) -> Path:
    """A small random Qwen2 (biases on q, k, v) with grouped-query attention."""
    tokenizer = build_tokenizer()
    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=kv_heads, max_position_embeddings=128,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_random_qwen3(folder: Path) -> Path:
    """A small random Qwen3 (per-head q/k norms before RoPE), 4 heads on 2 key/value heads."""
    tokenizer = build_tokenizer()
    torch.manual_seed(2)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=128,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dirs(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> dict[str, Path]:
    return {"llama": random_model_dir,
            "qwen2": save_random_qwen2(tmp_path_factory.mktemp("qwen2")),
            "qwen3": save_random_qwen3(tmp_path_factory.mktemp("qwen3"))}


@pytest.fixture(scope="module")
def batch(random_model_dir: Path) -> TrainBatch:
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32,
                                         eos_ids=[2], pad_id=0, seed=7)
    batch = collate(rollouts(engine, 1), pad_id=0)
    lengths = batch.attention_mask.sum(-1)
    assert lengths.min() < lengths.max()  # rows of several lengths: packing matters
    return batch


def test_packing_keeps_each_row_to_itself() -> None:
    rows = TrainBatch(input_ids=torch.tensor([[5, 6, 7], [8, 9, 0]]),
                      attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]),
                      response_mask=torch.ones(2, 2), behavior_logprobs=torch.zeros(2, 2),
                      versions=torch.zeros(2, 2, dtype=torch.long), rewards=torch.zeros(2),
                      group_ids=torch.tensor([0, 1]), response_lengths=torch.tensor([1, 1]),
                      sample_weights=torch.ones(2), baseline_rewards=torch.zeros(2))
    packed = pack_tokens(rows, 4)  # 5 tokens, padded to 8
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 0, 0]]
    assert packed.labels.tolist() == [[6, 7, 0, 9, 0, 0, 0, 0]]
    attend = packed.attend[0, 0]
    assert attend[2].tolist() == [True, True, True, False, False, False, False, False]
    assert attend[4].tolist() == [False, False, False, True, True, False, False, False]
    assert attend[6].tolist() == [False] * 6 + [True, False]  # padding sees itself only
    per_token = torch.arange(8.0)[None]
    assert packed.to_grid(per_token).tolist() == [[0.0, 1.0], [3.0, 0.0]]


@pytest.mark.usefixtures("one_rank_group")
def test_one_rank_packed_equals_the_padded_forward(random_model_dir: Path,
                                                   batch: TrainBatch) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    sp = SequenceParallel(dist.group.WORLD, size=1, rank=0)
    padded, padded_entropy = forward_logprobs(model, batch, 1.0, True)
    packed, packed_entropy = forward_logprobs(model, batch, 1.0, True, sp=sp)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_entropy[mask], padded_entropy[mask], atol=1e-5, rtol=1e-5)


def loss_and_grads(model: torch.nn.Module, batch: TrainBatch, weights: torch.Tensor,
                   sp: SequenceParallel | None) -> dict[str, torch.Tensor]:
    """A loss that reads every log-prob and entropy of the rows, and its gradients."""
    logprobs, entropy = forward_logprobs(model, batch, 0.7, True, sp=sp)
    mask = batch.attention_mask[:, 1:]
    loss = ((logprobs * weights[0] + entropy * weights[1]) * mask).sum()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return {"loss": loss.detach(), "logprobs": (logprobs * mask).detach(),
            "entropy": (entropy * mask).detach(), **grads}


def sp_worker(rank: int, world: int, port: int, model_dir: str, batch_file: str,
              out_file: str, checkpointing: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        batch, weights = torch.load(batch_file, weights_only=False)
        sp = learner_parallelism(torch.device("cpu"), world).sequence
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if checkpointing:  # the backward runs each block again: all-to-alls included
            enable_activation_checkpointing(model)
            model.train()
        result = loss_and_grads(model, batch, weights, sp)
        for name, _ in model.named_parameters():  # each rank holds its slice's share
            dist.all_reduce(result[name], group=sp.group)
        if rank == 0:
            torch.save(result, out_file)
    finally:
        dist.destroy_process_group()
    exit_worker()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "llama checkpointed"])
def test_sp2_gives_the_loss_and_gradients_of_one_process(
        family: str, model_dirs: dict[str, Path], batch: TrainBatch, tmp_path: Path) -> None:
    model_dir = model_dirs[family.split()[0]]
    torch.manual_seed(0)
    weights = torch.randn(2, *batch.response_mask.shape)
    batch_file = tmp_path / "batch.pt"
    torch.save((batch, weights), batch_file)
    out = tmp_path / "sp2.pt"
    mp.start_processes(sp_worker, args=(2, free_port(), str(model_dir), str(batch_file),
                                        str(out), family.endswith("checkpointed")),
                       nprocs=2, start_method="spawn")
    two = torch.load(out, weights_only=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    one = loss_and_grads(model, batch, weights, sp=None)
    assert set(two) == set(one)
    for name, expected in one.items():
        torch.testing.assert_close(two[name], expected, atol=2e-5, rtol=1e-4, msg=name)


ALGORITHMS = {"grpo": AlgorithmConfig(),
              "ppo with critic": AlgorithmConfig(adv_estimator="gae", lam=0.95)}


def train_worker(rank: int, world: int, port: int, sp_size: int, model_dir: str,
                 batch_file: str, algorithm: AlgorithmConfig, out_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        batch = torch.load(batch_file, weights_only=False)
        actor = ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0),
                            ppo_micro_batch_size_per_gpu=4,
                            ulysses_sequence_parallel_size=sp_size)
        learner = make_learner(Path(model_dir), actor=actor, algorithm=algorithm,
                               parallelism=learner_parallelism(torch.device("cpu"), sp_size))
        assert learner.micro.world == world // sp_size  # data-parallel ranks
        assert (learner.sp.size if learner.sp else 1) == sp_size
        assert learner.critic is None or learner.micro.sp is learner.sp
        metrics = [learner.step(batch, version=v).metrics for v in range(2)]
        weights = gather_full_weights(learner.model, torch.float32)
        if rank == 0:
            torch.save({"losses": [m["actor/loss"] for m in metrics],
                        "entropy": [m["actor/entropy"] for m in metrics],
                        "weights": weights}, out_file)
    finally:
        dist.destroy_process_group()
    exit_worker()


@pytest.mark.slow  # 4 processes twice: 25 s
@pytest.mark.parametrize("algorithm", ALGORITHMS.values(), ids=ALGORITHMS.keys())
def test_dp2_sp2_trains_to_the_weights_of_one_rank(random_model_dir: Path, batch: TrainBatch,
                                                   tmp_path: Path,
                                                   algorithm: AlgorithmConfig) -> None:
    batch_file = tmp_path / "batch.pt"
    torch.save(batch, batch_file)
    results = []
    for world, sp_size in ((1, 1), (4, 2)):
        out = tmp_path / f"world{world}.pt"
        mp.start_processes(train_worker, args=(world, free_port(), sp_size,
                                               str(random_model_dir), str(batch_file),
                                               algorithm, str(out)),
                           nprocs=world, start_method="spawn")
        results.append(torch.load(out, weights_only=False))
    one, four = results
    assert four["losses"] == pytest.approx(one["losses"], abs=1e-5)
    assert four["entropy"] == pytest.approx(one["entropy"], abs=1e-5)
    for name, tensor in one["weights"].items():  # as in test_ranks: Adam's ~lr sign flips
        close = torch.isclose(four["weights"][name], tensor, atol=LR / 100, rtol=1e-4)
        assert float(close.float().mean()) > 0.999, name
        torch.testing.assert_close(four["weights"][name], tensor, atol=LR / 5, rtol=1e-4)


@pytest.mark.parametrize(("heads", "kv_heads", "sp_size", "problem"), [
    (4, 2, 3, "must divide the model's 4 attention heads"),
    (6, 3, 2, "must divide the model's 3 key/value heads or be a multiple of them"),
])
def test_heads_that_do_not_fit_are_refused_naming_the_key(heads: int, kv_heads: int,
                                                          sp_size: int, problem: str) -> None:
    config = Qwen2Config(hidden_size=heads * 16, num_attention_heads=heads,
                         num_key_value_heads=kv_heads)
    with pytest.raises(ValueError, match="actor.ulysses_sequence_parallel_size") as caught:
        check_heads(config, sp_size)
    assert problem in str(caught.value)
    check_heads(Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=1), 4)


@pytest.mark.parametrize(("config", "problem"), [
    (MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=4096),
     "sliding-window attention"),
    (Gemma2Config(num_attention_heads=4, num_key_value_heads=2), "model_type 'gemma2'"),
])
def test_attention_other_than_plain_causal_is_refused(config, problem: str) -> None:
    with pytest.raises(ValueError, match="actor.ulysses_sequence_parallel_size = 2") as caught:
        check_heads(config, 2)
    assert problem in str(caught.value)
