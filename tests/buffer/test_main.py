"""The buffer process's training data: ``data.*`` options reach the rows it leases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

import relay.buffer.main as buffer_main
from relay.configs.prompt_data import DatasetError
from relay.configs.run_schema import DataConfig, ModelConfig, RunConfig

from ..configs.test_prompt_data import WordTokenizer


def _run(tmp_path: Path, **data) -> RunConfig:
    rows = [{"question": [{"role": "user", "content": " ".join(["w"] * words)}],
             "data_source": "s", "reward_model": {"style": "rule", "ground_truth": "1"}}
            for words in (2, 9, 3)]  # 3, 10 and 4 tokens with the WordTokenizer
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return RunConfig(data=DataConfig(train_files=[str(path)], prompt_key="question",
                                     max_prompt_length=4, **data),
                     model=ModelConfig(path=str(tmp_path / "model")))


@pytest.fixture
def tokenizers(monkeypatch) -> list[str]:
    """The model folders the buffer loads a tokenizer from (a WordTokenizer each)."""
    loaded: list[str] = []

    def from_pretrained(path, trust_remote_code):
        loaded.append(path)
        return WordTokenizer()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    return loaded


def test_filter_overlong_prompts_leaves_the_rows_that_fit(tmp_path, tokenizers) -> None:
    dataset = buffer_main.training_prompts(_run(tmp_path, filter_overlong_prompts=True))
    assert [len(row.prompt[0].content.split()) for row in dataset.rows] == [2, 3]
    assert tokenizers == [str(tmp_path / "model")]


def test_truncation_error_refuses_the_data_at_load(tmp_path, tokenizers) -> None:
    with pytest.raises(DatasetError, match="row 1 \\(10 tokens\\)"):
        buffer_main.training_prompts(_run(tmp_path, truncation="error"))


def test_cutting_sides_keep_every_row_without_a_tokenizer(tmp_path, tokenizers) -> None:
    for side in ("left", "right", "middle"):
        assert len(buffer_main.training_prompts(_run(tmp_path, truncation=side))) == 3
    assert tokenizers == []
