"""What the checks run on, made on the spot with no network: a random small Qwen2 with
Relay's tiny tokenizer, synthetic rollout groups, and the learner the run config builds.

Every call into the learner's and the engines' construction is here, once: the checks
build through the same entry points as ``relay.learner.main`` and ``relay.generators.build``.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from relay.configs import DEFAULT_RUN
from relay.configs.checks import load_run_config
from relay.configs.rundir import RunContext
from relay.configs.run_schema import ModelConfig
from relay.configs.topology_schema import GeneratorPlacement, Topology
from relay.generators.build import build_engine
from relay.generators.engine import Engine
from relay.learner.batch import TrainBatch, collate
from relay.learner.main import build_learner, init_learner_group
from relay.learner.tiny_model.tokenizer import build_tokenizer
from relay.learner.ulysses import Parallelism, SequenceParallel, learner_parallelism
from relay.learner.update import Learner
from relay.transport.messages import RolloutGroup, Sample

GROUPS, SAMPLES = 4, 4  # prompts a batch, samples a prompt
RESPONSE_LENGTH = 10  # at most, tokens a response
TEMPERATURE = 1.0


def save_random_qwen2(folder: Path, seed: int = 0) -> Path:
    """A randomly initialised Qwen2 (2 layers, 4 heads of 32 on 2 key/value heads, tied
    embeddings, init std 0.06 as Relay's tiny model) with Relay's tiny tokenizer, saved
    as any Hugging Face checkpoint."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         use_sliding_window=False, initializer_range=0.06,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def synthetic_groups(vocab: int, seed: int = 0) -> list[RolloutGroup]:
    """``GROUPS`` prompts of 6-14 tokens with ``SAMPLES`` responses of 3-``RESPONSE_LENGTH``
    tokens each (ids from 3 up: no special token), behavior log-probs near a uniform
    policy's (-log V + 0.1 N(0, 1)), version 0, rewards alternating 1, 0 within a group."""
    generator = torch.Generator().manual_seed(seed)

    def ids(low: int, high: int) -> torch.Tensor:
        length = int(torch.randint(low, high + 1, (), generator=generator))
        return torch.randint(3, vocab, (length,), generator=generator, dtype=torch.int32)

    groups = []
    for index in range(GROUPS):
        prompt = ids(6, 14)
        samples = []
        for k in range(SAMPLES):
            response = ids(3, RESPONSE_LENGTH)
            behavior = -math.log(vocab) + 0.1 * torch.randn(len(response), generator=generator)
            samples.append(Sample(prompt_ids=prompt, response_ids=response, logprobs=behavior,
                                  versions=torch.zeros(len(response), dtype=torch.int32),
                                  reward=float((k + 1) % 2)))
        groups.append(RolloutGroup(rollout_id=f"check/{index}", lease_id="check",
                                   prompt_id=str(index), generator_id="gpu-check",
                                   samples=samples))
    return groups


def host_batch(groups: list[RolloutGroup], device: torch.device) -> TrainBatch:
    """``groups`` collated on the host as ``TrainLoop`` does for a learner on ``device``
    (pinned for a GPU); ``Learner.step`` moves it."""
    return collate(groups, pad_id=0, pin_memory=device.type == "cuda")


def init_one_rank_group(device: torch.device) -> None:
    """A one-rank process group as ``relay.learner.main`` makes it (``init_learner_group``), over
    a free port on loopback (a new one each time: a process may make it again)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    init_learner_group(device, timeout=timedelta(minutes=5))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_learner(model_dir: Path, device: torch.device, dtype: str, overrides: list[str], *,
                  lr: float, ulysses: bool = False) -> Learner:
    """The learner ``relay.learner.main`` builds for the embedded default run config with
    ``overrides`` on the model at ``model_dir`` (a batch of ``GROUPS`` x ``SAMPLES``, ``lr``,
    no weight decay), sharded over the one-rank group; ``ulysses``: under Ulysses sequence
    parallelism with a group of one (every pass packed and split, by one rank)."""
    run = load_run_config(DEFAULT_RUN, [
        f"model.path={model_dir}", f"model.dtype={dtype}", f"data.train_batch_size={GROUPS}",
        f"rollout.n={SAMPLES}", f"rollout.response_length={RESPONSE_LENGTH}",
        f"rollout.temperature={TEMPERATURE}", f"actor.optim.lr={lr}",
        "actor.optim.weight_decay=0.0", "trainer.total_training_steps=10", *overrides])
    context = RunContext(run_dir=model_dir.parent, topology=Topology(), run=run)
    if ulysses:
        parallelism = Parallelism(sequence=SequenceParallel(dist.group.WORLD, size=1, rank=0))
    else:
        parallelism = learner_parallelism(device, run.actor.ulysses_sequence_parallel_size)
    torch.manual_seed(0)
    return build_learner(context, device, parallelism)


def check_engine(engine: str, model_dir: Path, device: torch.device, dtype: str, *,
                 slots: int, max_len: int) -> Engine:
    """The generator's ``engine`` (``lean``, ``vllm``) on ``device`` as ``relay.generators.build``
    makes it, holding the model at ``model_dir`` as version 0."""
    placement = GeneratorPlacement(name="gpu-check", engine=engine, device=str(device))
    built, _ = build_engine(ModelConfig(path=str(model_dir), dtype=dtype), placement, seed=0,
                            max_num_seqs=slots, max_len=max_len)
    return built


def cpu_copy(tensor: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A (possibly FSDP2-sharded) tensor whole, copied to the CPU in ``dtype``: a copy even
    on the CPU, since FSDP2 frees the storage of a parameter it unsharded."""
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().to("cpu", dtype, copy=True)


def local_device(tensor: torch.Tensor) -> torch.device:
    """Where this rank's part of ``tensor`` is stored."""
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).device
