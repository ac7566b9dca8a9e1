"""Ulysses sequence parallelism (relay.learner.ulysses) against the plain padded forward.

- packing: rows packed without padding, labels the next token of the same row, each row
  (and each padding token) a sequence of its own, the grid mapping back onto the rows;
- attention runs causally within each packed sequence, equal to a dense block-diagonal
  mask, and no tensor of the packed length squared is ever built (neither ours nor
  transformers' mask); a model not loaded with Relay's attention is refused;
- one rank (an SP group of 1): the packed forward gives the padded forward's log-probs;
- SP 2 on a Llama model (2 key/value heads, split), a Qwen2 model (1 key/value head,
  repeated) and a Qwen3 model (per-head q/k norms, head_dim not hidden / heads): the same
  log-probs, entropies, loss and summed gradients as one process without SP, on rows of
  different lengths (real processes, gloo), and with gradient checkpointing;
- DP 2 x SP 2 (4 processes, FSDP2 over all of them) trains two steps to the weights and
  the reported gradient norms of DP 1 x SP 1, for GRPO and for PPO with its critic;
- head counts that do not fit are refused naming the key, for the models a run loads only.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    MistralConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from relay.configs import DEFAULT_RUN, Topology, load_run_config
from relay.configs.rundir import RunContext
from relay.configs.run_schema import ActorConfig, AlgorithmConfig, OptimConfig
from relay.generators.torch_engine import TorchEngine
from relay.learner.attention import ATTENTION
from relay.learner.batch import TrainBatch, collate
from relay.learner.main import build_learner
from relay.learner.model import enable_activation_checkpointing, forward_logprobs
from relay.learner.tiny_model.tokenizer import build_tokenizer
from relay.learner.ulysses import (
    SequenceParallel,
    UlyssesAttention,
    check_heads,
    learner_parallelism,
    pack_tokens,
    ulysses_attention,
)
from relay.learner.varlen import PackedSequences

from ..conftest import exit_worker, free_port, gather_full_weights
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
    """A small random Qwen3 (per-head q/k norms before RoPE), 4 heads on 2 key/value heads,
    of head_dim 32, not hidden / heads (16)."""
    tokenizer = build_tokenizer()
    torch.manual_seed(2)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=128,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def relay_model(model_dir: Path) -> nn.Module:
    """The model at ``model_dir`` attending with ``relay.learner.attention``, as the learner loads it."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation=ATTENTION)


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
    assert packed.cu_seqlens == (0, 3, 5, 6, 7, 8)  # rows of 3 and 2; padding one by one
    per_token = torch.arange(8.0)[None]
    assert packed.to_grid(per_token).tolist() == [[0.0, 1.0], [3.0, 0.0]]


@pytest.mark.usefixtures("one_rank_group")
def test_attention_is_causal_within_each_packed_sequence_only() -> None:
    lengths = [5, 1, 7, 3, 1, 1]  # four rows, then two padding tokens
    cu_seqlens = (0, 5, 6, 13, 16, 17, 18)
    torch.manual_seed(0)
    query = torch.randn(1, 4, 18, 8)  # 4 query heads on 2 key/value heads
    key, value = torch.randn(2, 1, 2, 18, 8).unbind(0)
    sp = SequenceParallel(dist.group.WORLD, size=1, rank=0)
    out, _ = ulysses_attention(nn.Module().eval(), query, key, value, None, scaling=0.3,
                               ulysses=UlyssesAttention(sp=sp, sequences=PackedSequences.of(
                                   cu_seqlens, device=query.device)))
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    attend = (sequence[:, None] == sequence[None, :]) & torch.ones(18, 18, dtype=torch.bool).tril()
    expected = F.scaled_dot_product_attention(query, key.repeat_interleave(2, dim=1),
                                              value.repeat_interleave(2, dim=1),
                                              attn_mask=attend, scale=0.3)
    torch.testing.assert_close(out, expected.transpose(1, 2))


class TensorShapes(TorchDispatchMode):
    """Records the shape of every tensor an operation returns while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


@pytest.mark.usefixtures("one_rank_group")
def test_the_packed_forward_builds_no_mask_of_the_packed_length_squared(
        random_model_dir: Path, batch: TrainBatch) -> None:
    model = relay_model(random_model_dir)
    sp = SequenceParallel(dist.group.WORLD, size=1, rank=0)  # a slice is the whole sequence
    tokens = int(batch.attention_mask.sum())
    with TensorShapes() as seen:
        forward_logprobs(model, batch, 1.0, True, sp=sp)
    assert any(tokens in shape for shape in seen.shapes)  # it saw the packed forward
    assert not [shape for shape in seen.shapes if shape[-2:] == (tokens, tokens)]


@pytest.mark.usefixtures("one_rank_group")
def test_a_packed_forward_refuses_a_model_not_loaded_with_relay_attention(
        random_model_dir: Path, batch: TrainBatch) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    sp = SequenceParallel(dist.group.WORLD, size=1, rank=0)
    for packed in (dict(sp=sp), dict(share_prompts=True)):
        with pytest.raises(ValueError, match="attn_implementation='relay'"):
            forward_logprobs(model, batch, 1.0, False, **packed)


@pytest.mark.usefixtures("one_rank_group")
def test_one_rank_packed_equals_the_padded_forward(random_model_dir: Path,
                                                   batch: TrainBatch) -> None:
    model = relay_model(random_model_dir)
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
        model = relay_model(Path(model_dir))
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
                 batch_file: str, algorithm: AlgorithmConfig, out_file: str,
                 fsdp_size: int = -1) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        batch = torch.load(batch_file, weights_only=False)
        actor = ActorConfig(optim=OptimConfig(lr=LR, weight_decay=0.0),
                            ppo_micro_batch_size_per_gpu=4,
                            ulysses_sequence_parallel_size=sp_size)
        learner = make_learner(Path(model_dir), actor=actor, algorithm=algorithm,
                               parallelism=learner_parallelism(torch.device("cpu"), sp_size),
                               fsdp_size=fsdp_size)
        assert learner.micro.world == world // sp_size  # data-parallel ranks
        assert (learner.sp.size if learner.sp else 1) == sp_size
        assert learner.critic is None or learner.micro.sp is learner.sp
        mesh = (world,) if fsdp_size == -1 else (world // fsdp_size, fsdp_size)
        assert next(learner.model.parameters()).device_mesh.shape == mesh
        metrics = [learner.step(batch, version=v).metrics for v in range(2)]
        weights = gather_full_weights(learner.model, torch.float32)
        if rank == 0:
            torch.save({"losses": [m["actor/loss"] for m in metrics],
                        "entropy": [m["actor/entropy"] for m in metrics],
                        "grad_norms": {name: [m[name] for m in metrics] for name in metrics[0]
                                       if name.endswith("grad_norm")},
                        "weights": weights}, out_file)
    finally:
        dist.destroy_process_group()
    exit_worker()


@pytest.mark.slow  # 4 processes twice: 25 s
@pytest.mark.parametrize("algorithm, fsdp_size",
                         [(a, -1) for a in ALGORITHMS.values()]
                         + [(ALGORITHMS["ppo with critic"], 2)],
                         ids=[*ALGORITHMS, "ppo with critic, hsdp 2x2"])
def test_dp2_sp2_trains_to_the_weights_of_one_rank(random_model_dir: Path, batch: TrainBatch,
                                                   tmp_path: Path, algorithm: AlgorithmConfig,
                                                   fsdp_size: int) -> None:
    """Also with every model hybrid-sharded as 2 x 2 (``fsdp_size = 2``): the FSDP2 mesh
    and Ulysses' dp x sp mesh are independent, and gradients still average over all 4."""
    batch_file = tmp_path / "batch.pt"
    torch.save(batch, batch_file)
    results = []
    for world, sp_size in ((1, 1), (4, 2)):
        out = tmp_path / f"world{world}.pt"
        mp.start_processes(train_worker, args=(world, free_port(), sp_size,
                                               str(random_model_dir), str(batch_file),
                                               algorithm, str(out),
                                               fsdp_size if world > 1 else -1),
                           nprocs=world, start_method="spawn")
        results.append(torch.load(out, weights_only=False))
    one, four = results
    assert four["losses"] == pytest.approx(one["losses"], abs=1e-5)
    assert four["entropy"] == pytest.approx(one["entropy"], abs=1e-5)
    assert "actor/grad_norm" in one["grad_norms"]  # and critic/grad_norm with the critic
    assert four["grad_norms"].keys() == one["grad_norms"].keys()
    for name, norms in one["grad_norms"].items():
        assert four["grad_norms"][name] == pytest.approx(norms, rel=1e-4), name
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


@pytest.mark.parametrize(("key", "estimator", "refused"), [
    ("critic.model.path", "grpo", False),
    ("critic.model.path", "gae", True),
    ("reward_model.model.path", "grpo", False),
    ("reward_model.model.path", "prime", True),
])
def test_only_the_models_a_run_loads_are_checked_against_the_sp_size(
        key: str, estimator: str, refused: bool, random_model_dir: Path,
        tmp_path: Path) -> None:
    misfit = tmp_path / "misfit"  # 3 key/value heads: no fit for an SP group of 2
    Qwen2Config(vocab_size=len(build_tokenizer()), hidden_size=96, num_attention_heads=6,
                num_key_value_heads=3).save_pretrained(misfit)
    run = load_run_config(DEFAULT_RUN, [f"model.path={random_model_dir}", f"{key}={misfit}",
                                        f"algorithm.adv_estimator={estimator}",
                                        "actor.ulysses_sequence_parallel_size=2"])
    ctx = RunContext(run_dir=tmp_path, topology=Topology(), run=run)
    if refused:
        with pytest.raises(ValueError, match="actor.ulysses_sequence_parallel_size = 2"):
            build_learner(ctx, torch.device("cpu"))
    else:  # the misfit is never loaded: nothing to check
        assert build_learner(ctx, torch.device("cpu")).critic is None
