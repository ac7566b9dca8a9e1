"""tools/prepare-data.py: the arithmetic files and GSM8K conversion.

Most tests call the tool's ``main`` in-process (an interpreter start costs seconds); one
runs it as a program, the way users do.
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from relay.algorithms.tasks import arithmetic
from relay.configs import CONFIG_DIR
from relay.configs.prompt_data import load_prompt_rows

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "prepare-data.py"
GSM8K_TRAIN = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def _run(*args: str) -> int:
    return runpy.run_path(str(TOOL))["main"](list(args))


def test_arithmetic_writes_disjoint_verl_rows_with_correct_ground_truth(tmp_path):
    code = _run(
        "arithmetic", "--out-dir", str(tmp_path), "--train-rows", "200", "--test-rows", "40"
    )
    assert code == 0
    train = load_prompt_rows(tmp_path / "arithmetic-train.jsonl")
    test = load_prompt_rows(tmp_path / "arithmetic-test.jsonl")
    assert (len(train), len(test)) == (200, 40)
    for split, rows in (("train", train), ("test", test)):
        for index, row in enumerate(rows):
            assert row.data_source == "relay/arithmetic"
            assert row.reward_model.style == "rule"
            assert row.extra_info == {"split": split, "index": index}
            (message,) = row.prompt
            _, _, a, op, b = message.content.rstrip("?").split(" ")
            problem = arithmetic.Problem(int(a), op, int(b))
            assert message.content == problem.question
            assert row.reward_model.ground_truth == str(problem.answer)
    assert not {r.prompt for r in train} & {r.prompt for r in test}


def test_shipped_arithmetic_files_are_what_the_tool_writes_by_default(tmp_path):
    assert _run("arithmetic", "--out-dir", str(tmp_path)) == 0
    for name, rows in (("arithmetic-train.jsonl", 5000), ("arithmetic-test.jsonl", 300)):
        shipped = (CONFIG_DIR / "data" / name).read_bytes()
        assert shipped == (tmp_path / name).read_bytes(), f"regenerate {name} with the tool"
        assert shipped.count(b"\n") == rows


def test_gsm8k_inline_sample_converts_to_parquet(tmp_path):
    source = tmp_path / "gsm8k.jsonl"
    source.write_text(
        json.dumps({"question": "How many?", "answer": "10 * 123.4 = 1234\n#### 1,234"})
        + "\n"
        + json.dumps({"question": "Owed?", "answer": "#### -5", "id": 9})
        + "\n"
    )
    assert _run("gsm8k", str(source), str(tmp_path / "out.parquet"), "--split", "test") == 0
    rows = load_prompt_rows(tmp_path / "out.parquet")
    assert [r.reward_model.ground_truth for r in rows] == ["1234", "-5"]
    assert rows[0].data_source == "openai/gsm8k"
    assert rows[0].prompt[0].content == (
        'How many? Let\'s think step by step and output the final answer after "####".'
    )
    assert rows[1].extra_info == {
        "split": "test",
        "index": 1,
        "answer": "#### -5",
        "question": "Owed?",
    }


def test_gsm8k_malformed_record_fails_naming_file_line_and_field(tmp_path):
    source = tmp_path / "gsm8k.jsonl"
    good = {"question": "q", "answer": "#### 1"}
    source.write_text("\n".join(json.dumps(r) for r in [good, {"question": "q"}, good]) + "\n")
    done = subprocess.run(
        [sys.executable, str(TOOL), "gsm8k", str(source), str(tmp_path / "out.jsonl")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 1
    assert f"{source}:2: field `answer`: expected a string, got nothing" in done.stderr
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.skipif(not GSM8K_TRAIN.is_file(), reason=f"GSM8K sample not found at {GSM8K_TRAIN}")
def test_gsm8k_real_rows_convert(tmp_path):
    source = tmp_path / "head.jsonl"
    lines = GSM8K_TRAIN.read_text().splitlines()[:20]
    source.write_text("\n".join(lines) + "\n")
    assert _run("gsm8k", str(source), str(tmp_path / "out.jsonl")) == 0
    rows = load_prompt_rows(tmp_path / "out.jsonl")
    assert len(rows) == 20
    first = json.loads(lines[0])
    assert rows[0].extra_info == {"split": "train", "index": 0, **first}
    assert rows[0].reward_model.ground_truth == first["answer"].rsplit("#### ", 1)[1].replace(
        ",", ""
    )
    assert all(r.reward_model.ground_truth.lstrip("-").replace(".", "").isdigit() for r in rows)
