"""relay.learner.hf_export: the policy written shard by shard loads back with transformers as the
same model, in one file or in several with an index, a parameter split across buckets
included; a run's final policy (``save_final``: in the run's dtype, with its tokenizer, from
one rank or gathered from two) and a checkpoint's folder converted to another dtype
(``convert_folder``) load back too, and neither leaves a partial folder under its name. A
whole state dict (``write_state``) is written with the source's tokenizer and config, sharded
with an index past ``shard_bytes``, and one that does not fit its model is refused naming
the keys, writing nothing; a critic's names map onto a token classifier's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from relay.learner import hf_export
from relay.learner.hf_export import (
    INDEX_FILE,
    SINGLE_FILE,
    StateMismatch,
    convert_folder,
    save_final,
    save_hf,
    value_model_as_token_classification,
    write_state,
)
from relay.learner.model import load_sharded

from ..conftest import exit_worker, free_port, gather_full_weights


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


def test_the_final_policy_is_in_the_runs_dtype_with_its_tokenizer(random_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(random_model_dir)
    final = save_final(model, tmp_path / "final", torch.bfloat16, tokenizer=tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no final.tmp left
    config = json.loads((final / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert (final / "generation_config.json").is_file()
    back = AutoModelForCausalLM.from_pretrained(final)
    assert back.dtype == torch.bfloat16
    weights = dict(back.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(weights[name], param.to(torch.bfloat16)), name
    again = AutoTokenizer.from_pretrained(final)
    assert again("1+2=")["input_ids"] == tokenizer("1+2=")["input_ids"]


def test_a_failed_final_write_leaves_the_previous_final_whole(
        random_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    final = save_final(model, tmp_path / "final", torch.float32)
    before = {p.name: p.read_bytes() for p in final.iterdir()}

    def crash(*_args, **_kwargs) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(hf_export, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_final(model, final, torch.bfloat16)
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before
    monkeypatch.undo()
    save_final(model, final, torch.bfloat16)  # the leftover final.tmp is cleared first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_checkpoint_folder_converts_to_another_dtype_shard_by_shard(
        random_model_dir: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    embed = model.get_input_embeddings().weight
    save_hf(model, tmp_path / "hf", torch.float32, shard_bytes=embed.numel() * 4 // 3)
    AutoTokenizer.from_pretrained(random_model_dir).save_pretrained(tmp_path / "hf")
    convert_folder(tmp_path / "hf", tmp_path / "out", torch.float16)
    out = tmp_path / "out"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]
    index = json.loads((out / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(p.numel() * 2 for p in model.parameters())
    back = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    for name, param in model.named_parameters():
        assert back[name].dtype == torch.float16 and torch.equal(
            back[name], param.to(torch.float16)), name
    assert len(AutoTokenizer.from_pretrained(out)) == len(
        AutoTokenizer.from_pretrained(random_model_dir))


def final_from_ranks(rank: int, world: int, port: int, model_dir: str, folder: str,
                     out_file: str) -> None:
    """Shard the model over ``world`` ranks, write its final folder, keep the full weights."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = load_sharded(model_dir, compute_dtype=torch.float32,
                             device=torch.device("cpu"))
        tokenizer = AutoTokenizer.from_pretrained(model_dir) if rank == 0 else None
        save_final(model, Path(folder), torch.bfloat16, tokenizer=tokenizer)
        weights = gather_full_weights(model, torch.bfloat16)
        if rank == 0:
            torch.save(weights, out_file)
    finally:
        dist.destroy_process_group()
    exit_worker()


def test_the_final_policy_of_two_ranks_is_gathered_whole(random_model_dir: Path,
                                                         tmp_path: Path) -> None:
    mp.start_processes(final_from_ranks, nprocs=2, start_method="spawn",
                       args=(2, free_port(), str(random_model_dir), str(tmp_path / "final"),
                             str(tmp_path / "weights.pt")))
    expected = torch.load(tmp_path / "weights.pt")
    back = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "final").named_parameters())
    assert set(back) == set(expected)
    for name, weight in expected.items():
        assert torch.equal(back[name], weight), name
    assert AutoTokenizer.from_pretrained(tmp_path / "final") is not None


def test_a_state_dict_is_written_sharded_with_the_sources_side_files(
        random_model_dir: Path, tmp_path: Path) -> None:
    state = AutoModelForCausalLM.from_pretrained(random_model_dir).state_dict()
    write_state(state, AutoConfig.from_pretrained(random_model_dir), AutoModelForCausalLM,
                tmp_path / "out", torch.bfloat16, files_from=random_model_dir,
                shard_bytes=20_000)
    index = json.loads((tmp_path / "out" / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    back = loaded(tmp_path / "out")
    for name, weight in back.items():
        assert torch.equal(weight, state[name].to(torch.bfloat16).float()), name
    assert len(AutoTokenizer.from_pretrained(tmp_path / "out")) > 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_state_dict_that_does_not_fit_is_refused_naming_the_keys(
        random_model_dir: Path, tmp_path: Path) -> None:
    state = AutoModelForCausalLM.from_pretrained(random_model_dir).state_dict()
    state.pop("model.norm.weight")
    state["model.extra"] = torch.zeros(1)
    state["model.embed_tokens.weight"] = torch.zeros(3, 3)
    with pytest.raises(StateMismatch, match=r"missing: model\.norm\.weight; unexpected: "
                                            r"model\.extra; of another shape: "
                                            r"model\.embed_tokens\.weight \(3, 3\)"):
        write_state(state, AutoConfig.from_pretrained(random_model_dir), AutoModelForCausalLM,
                    tmp_path / "out", torch.float32)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_a_critics_names_become_a_token_classifiers() -> None:
    state = {"body.norm.weight": torch.ones(2), "value_head.weight": torch.ones(1, 2),
             "value_head.bias": torch.zeros(1)}
    assert list(value_model_as_token_classification(state, "model")) == [
        "model.norm.weight", "score.weight", "score.bias"]
    with pytest.raises(StateMismatch, match="'head.weight' is neither"):
        value_model_as_token_classification({"head.weight": torch.ones(1)}, "model")
