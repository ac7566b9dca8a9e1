"""relay.learner.model's loading and sharding: rank 0 reads a checkpoint, the other ranks build
the model on ``meta`` and receive their shards from it (two gloo ranks, real processes), and
every model ends up as if each rank had read the checkpoint itself (the old path): the
policy (tied embeddings or not), the frozen reference in its compute dtype, the critic;
``sharding_mesh`` refuses an ``fsdp_size`` that does not divide the ranks, naming its key.
(HSDP's same update: test_ranks.py; its publish: test_weight_buckets.py; its checkpoints:
test_checkpoint.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel

from relay.learner.attention import ATTENTION
from relay.learner.critic import load_value_model, with_value_head
from relay.learner.model import load_sharded, sharding_mesh

from ..conftest import exit_worker, free_port
from .test_ulysses import save_random_qwen2

IDS = torch.tensor([[1, 271, 201, 273, 272, 223, 19, 20], [1, 24, 25, 26, 27, 2, 201, 278]])
CPU = torch.device("cpu")


def count_weight_reads() -> list[str]:
    """From now on, every ``from_pretrained`` of this process (what each Auto class calls to
    read a checkpoint's weights) appends its model class to the returned list."""
    reads: list[str] = []
    read = PreTrainedModel.from_pretrained.__func__

    def counted(cls, *args, **kwargs):  # noqa: ANN001, ANN202 - transformers' signature
        reads.append(cls.__name__)
        return read(cls, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(counted)
    return reads


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole in its own dtype, and every buffer (a collective)."""
    with torch.no_grad():
        state = {name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                 for name, p in model.named_parameters()}
    return state | {name: buffer.clone() for name, buffer in model.named_buffers()}


def load_on_rank(rank: int, world: int, port: int, tied_dir: str, untied_dir: str,
                 out_prefix: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        reads = count_weight_reads()
        models = {
            "policy": load_sharded(tied_dir, compute_dtype=torch.float32, device=CPU,
                                   gradient_checkpointing=True),
            "untied policy": load_sharded(untied_dir, compute_dtype=torch.float32, device=CPU),
            "reference": load_sharded(tied_dir, compute_dtype=torch.bfloat16, device=CPU,
                                      trainable=False),
            "critic": load_value_model(tied_dir, compute_dtype=torch.float32, device=CPU,
                                       gradient_checkpointing=True),
        }
        with torch.no_grad():
            outputs = {"policy": models["policy"](input_ids=IDS).logits,
                       "untied policy": models["untied policy"](input_ids=IDS).logits,
                       "critic": models["critic"](IDS)}
        tied = [m.lm_head.weight is m.model.embed_tokens.weight
                for m in (models["policy"], models["untied policy"])]
        assert models["policy"].is_gradient_checkpointing
        assert models["critic"].body.is_gradient_checkpointing
        torch.save({"reads": reads, "tied": tied, "outputs": outputs,
                    "weights": {name: whole(m) for name, m in models.items()},
                    "trainable": {name: any(p.requires_grad for p in m.parameters())
                                  for name, m in models.items()}},
                   f"{out_prefix}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    exit_worker()


def read_whole(path: Path, auto: type = AutoModelForCausalLM) -> nn.Module:
    """The model as every rank used to read it: fp32, whole."""
    return auto.from_pretrained(path, dtype=torch.float32, attn_implementation=ATTENTION)


def assert_same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(loaded) == list(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


def test_two_ranks_load_from_rank_zero_what_each_read_before(random_model_dir: Path,
                                                             tmp_path: Path) -> None:
    """Rank 0 alone reads the weights; on both ranks each model's full parameters and its
    buffers (RoPE's inv_freq, outside the state dict) equal, bitwise, those of the
    checkpoint read whole in fp32 (the reference's cast to bf16, its compute dtype), tied
    embeddings stay tied, and the sharded forwards compute what the whole model does.
    Gradient checkpointing is set on the policy and the critic, models built on meta too."""
    untied_dir = save_random_qwen2(tmp_path / "qwen2")
    mp.start_processes(load_on_rank, nprocs=2, start_method="spawn",
                       args=(2, free_port(), str(random_model_dir), str(untied_dir),
                             str(tmp_path / "loaded")))
    policy, untied = read_whole(random_model_dir), read_whole(untied_dir)
    critic = with_value_head(read_whole(random_model_dir, AutoModel))
    parameters = dict(policy.named_parameters())
    expected = {"policy": whole(policy), "untied policy": whole(untied), "critic": whole(critic),
                "reference": {name: t.to(torch.bfloat16) if name in parameters else t
                              for name, t in whole(policy).items()}}
    with torch.no_grad():
        outputs = {"policy": policy(input_ids=IDS).logits,
                   "untied policy": untied(input_ids=IDS).logits}
    for rank in (0, 1):
        loaded = torch.load(tmp_path / f"loaded-rank{rank}.pt", weights_only=False)
        assert loaded["reads"] == (["LlamaForCausalLM", "Qwen2ForCausalLM",
                                    "LlamaForCausalLM", "LlamaModel"] if rank == 0 else [])
        assert loaded["tied"] == [True, False]
        assert loaded["trainable"] == {"policy": True, "untied policy": True,
                                       "reference": False, "critic": True}
        for name, weights in expected.items():
            assert_same(loaded["weights"][name], weights)
        for name, logits in outputs.items():
            torch.testing.assert_close(loaded["outputs"][name], logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(loaded["outputs"]["critic"], torch.zeros(IDS.shape))


def test_one_process_holds_the_frozen_reference_in_its_compute_dtype(
        random_model_dir: Path) -> None:
    """Without a process group too: the reference's parameters are the checkpoint's cast to
    the compute dtype, frozen; the policy's stay fp32 master weights."""
    reference = load_sharded(str(random_model_dir), compute_dtype=torch.bfloat16, device=CPU,
                             trainable=False)
    policy = load_sharded(str(random_model_dir), compute_dtype=torch.bfloat16, device=CPU)
    read = dict(read_whole(random_model_dir).named_parameters())
    for name, param in reference.named_parameters():
        assert param.dtype == torch.bfloat16 and not param.requires_grad, name
        assert torch.equal(param, read[name].to(torch.bfloat16)), name
    assert {p.dtype for p in policy.parameters()} == {torch.float32}


def test_no_process_group_no_mesh() -> None:
    assert sharding_mesh(CPU, 2) is None


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("fsdp_size", [-1, 1])
def test_fsdp_size_minus_one_or_the_world_shards_over_every_rank(fsdp_size: int) -> None:
    mesh = sharding_mesh(CPU, fsdp_size)
    assert mesh.shape == (1,) and mesh.mesh_dim_names == ("shard",)


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("fsdp_size", [0, 2, -2])
def test_an_fsdp_size_that_does_not_divide_the_ranks_is_refused_naming_the_key(
        fsdp_size: int) -> None:
    key = "critic.model.fsdp_config.fsdp_size"
    with pytest.raises(ValueError, match=rf"^{key} = {fsdp_size}: must be -1 .* divide the "
                                         r"learner's 1 ranks"):
        sharding_mesh(CPU, fsdp_size, key)
