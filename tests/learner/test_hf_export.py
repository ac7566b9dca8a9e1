"""relay.learner.hf_export: the policy written shard by shard loads back with transformers as the
same model, in one file or in several with an index, a parameter split across buckets
included."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from relay.learner.hf_export import INDEX_FILE, SINGLE_FILE, save_hf


def loaded(folder: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return dict(model.named_parameters())


def test_one_shard_is_model_safetensors_and_loads_back(random_model_dir: Path,
                                                       tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    save_hf(model, tmp_path / "hf", torch.float32)
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert SINGLE_FILE in files and INDEX_FILE not in files and "config.json" in files
    back = loaded(tmp_path / "hf")
    for name, param in model.named_parameters():
        assert torch.equal(back[name], param), name


def test_many_shards_with_split_parameters_load_back(random_model_dir: Path,
                                                     tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    embed = model.get_input_embeddings().weight
    shard_bytes = embed.numel() * 4 // 3  # the embedding spans two buckets
    save_hf(model, tmp_path / "hf", torch.float32, shard_bytes=shard_bytes)
    folder = tmp_path / "hf"
    index = json.loads((folder / INDEX_FILE).read_text())
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(
        p.numel() * 4 for p in model.parameters())
    back = loaded(folder)
    for name, param in model.named_parameters():
        assert torch.equal(back[name], param), name
