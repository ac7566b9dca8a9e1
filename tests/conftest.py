"""Fixtures shared across the test tree: a small random model with the real tokenizer,
and a one-rank gloo process group for code that needs ``torch.distributed``."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from learner.tiny_model.tokenizer import build_tokenizer


def save_random_model(folder: Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """A randomly initialized small Llama with Relay's tiny tokenizer, saved like any HF model."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden,
                         intermediate_size=hidden * 2, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2,
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
