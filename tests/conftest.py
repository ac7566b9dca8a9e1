"""Fixtures shared across the test tree: a small random model with the real tokenizer,
a one-rank gloo process group for code that needs ``torch.distributed``, and a (sharded)
model's weights gathered whole to compare with."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from relay.learner.tiny_model.tokenizer import build_tokenizer
from relay.learner.weight_buckets import plan_buckets
from relay.learner.weights import StreamStats, WeightServer, WeightStream, publish_weights


def save_random_model(folder: Path, seed: int = 0, hidden: int = 64, layers: int = 2,
                      head_dim: int | None = None) -> Path:
    """A randomly initialized small Llama with Relay's tiny tokenizer, saved like any HF model;
    4 heads on 2 key/value heads of ``head_dim`` (default ``hidden // 4``)."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden,
                         intermediate_size=hidden * 2, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=128, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_model(tmp_path_factory.mktemp("random-model"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def exit_worker() -> None:
    """End a spawned worker that finished its work (process group destroyed) at once.

    Left to interpreter teardown, a gloo worker process sometimes aborts after its last
    line ("terminate called without an active exception", SIGABRT, no Python frame), and
    the spawning test fails on work that was done. Exiting here skips that teardown; a
    worker that raised never gets here, so its failure still counts."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture
def one_rank_group():
    """A real gloo process group of world size 1 in this process."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def gather_full_weights(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every parameter of a (sharded) model whole, on rank 0 (other ranks get {}); call on
    every rank. The reference the tests compare trained weights with."""
    is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
            if is_rank0:
                out[name] = full.to(device="cpu", dtype=dtype).contiguous()
    return out


class LearnerSide:
    """Rank 0's weight server and stream over loopback, publishing ``model`` in bf16
    buckets of ``bucket_bytes`` as ``TrainLoop._serve`` does."""

    def __init__(self, model: nn.Module, bucket_bytes: int) -> None:
        self.model = model
        self.plan = plan_buckets(model, torch.bfloat16, bucket_bytes)
        self.server = WeightServer("tcp://127.0.0.1:*").start()
        self.stream = WeightStream("tcp://127.0.0.1:*")

    def publish(self, version: int, step: int | None = None) -> StreamStats:
        """Stream ``model`` as ``version`` (taken after ``step``, default ``version``),
        then name it the newest."""
        step = version if step is None else step
        self.server.take_resend()
        stats = publish_weights(self.model, self.plan, torch.bfloat16, version=version,
                                step=step, stream=self.stream)
        self.server.published(version, step)
        return stats

    def publish_until(self, version: int, arrived, timeout_s: float = 20.0) -> None:
        """Publish, and again whenever a subscriber asks (as the learner does while it waits
        for a batch), until ``arrived()``."""
        self.publish(version)
        deadline = time.monotonic() + timeout_s
        while not arrived() and time.monotonic() < deadline:
            if self.server.resend_wanted():
                self.publish(version)
            time.sleep(0.02)
        assert arrived(), f"version {version} did not arrive within {timeout_s:g} s"

    def greet(self, heard: Callable[[], bool], timeout_s: float = 20.0) -> None:
        """Stream ``StreamBeacon``s, as the learner does while it waits for the evaluator's
        first request, until ``heard()`` (a subscriber has heard one)."""
        deadline = time.monotonic() + timeout_s
        while not heard():
            assert time.monotonic() < deadline, "no subscriber heard the stream"
            self.stream.beacon()

    def close(self) -> None:
        self.stream.close()
        self.server.stop()
