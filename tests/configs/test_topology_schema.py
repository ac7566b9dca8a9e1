"""A generator's and the evaluator's engine settings are one section, declared once and
checked alike under both keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.configs import ConfigError, load_topology
from relay.configs.topology_schema import EnginePlacement, EvaluatorPlacement, GeneratorPlacement

ENGINE_FIELDS = EnginePlacement.__struct_fields__


def test_engine_fields_are_declared_once_for_both_placements() -> None:
    assert ENGINE_FIELDS == ("cpus", "memory_gib", "resources", "host", "engine", "device",
                             "gpus", "threads", "lean", "vllm", "sglang")
    assert EvaluatorPlacement.__struct_fields__ == ENGINE_FIELDS
    assert GeneratorPlacement.__struct_fields__ == (*ENGINE_FIELDS, "name", "max_restarts")
    for placement in (GeneratorPlacement, EvaluatorPlacement):
        assert "host" not in vars(placement).get("__annotations__", {})


@pytest.mark.parametrize("section, key", [("[[generators]]\nname = \"g\"", "generators[0]"),
                                          ("[evaluator]", "evaluator")])
@pytest.mark.parametrize("line, field, problem", [
    ("threads = -1", "threads", ">= 0"),
    ('engine = "jax"', "engine", "'hf', 'lean', 'sglang', 'torch', 'vllm'"),
    ("gpus = [-1]", "gpus[0]", ">= 0"),
    ("lean.max_num_batched_tokens = 0", "lean.max_num_batched_tokens", ">= 1"),
    ("hosts = []", "hosts", "did you mean"),
])
def test_a_bad_engine_key_names_the_file_and_its_section(tmp_path: Path, section: str,
                                                         key: str, line: str, field: str,
                                                         problem: str) -> None:
    path = tmp_path / "topology.toml"
    path.write_text(f"{section}\n{line}\n")
    with pytest.raises(ConfigError) as info:
        load_topology(path)
    assert (info.value.source, info.value.key) == (str(path), f"{key}.{field}")
    assert problem in info.value.problem


def test_only_a_generator_has_a_name(tmp_path: Path) -> None:
    path = tmp_path / "topology.toml"
    path.write_text('[evaluator]\nname = "e"\n')
    with pytest.raises(ConfigError) as info:
        load_topology(path)
    assert info.value.key == "evaluator.name"
    path.write_text('[[generators]]\nhost = "127.0.0.1"\n')
    with pytest.raises(ConfigError) as info:
        load_topology(path)
    assert info.value.key == "generators[0].name"
