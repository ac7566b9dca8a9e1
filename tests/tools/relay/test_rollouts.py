"""``relay rollouts``: a step's groups written with the buffer's ``RolloutLogWriter`` come
back through the command, as JSONL and readably, decoded with the run's tokenizer; a run
without a log, a step not recorded and a damaged log are exit code 2 saying so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relay.buffer.hub import with_admission
from relay.buffer.rollout_log import RolloutLogWriter, StepRecord
from relay.buffer.store import Admission
from relay.learner.tiny_model.tokenizer import build_tokenizer
from relay.rollouts import main
from relay.transport.messages import RolloutGroup, Sample

TOKENIZER = build_tokenizer()
TRAINED_AT = 4


def ids(text: str) -> torch.Tensor:
    return torch.tensor(TOKENIZER.encode(text), dtype=torch.int32)


def sample(prompt: str, response: str, reward: float, versions: list[int]) -> Sample:
    """Tokens of ``versions``, the last one repeated to the response's length."""
    response_ids = ids(response)
    length = len(response_ids)
    padded = (versions + versions[-1:] * length)[:length]
    return Sample(prompt_ids=ids(prompt), response_ids=response_ids,
                  logprobs=torch.full((length,), -0.5),
                  versions=torch.tensor(padded, dtype=torch.int32), reward=reward,
                  reward_info={"format_ok": 1.0})


PROMPTS = ("What is 3 + 4?", "What is 9 - 2?")


def group(name: str, samples: list[Sample]) -> RolloutGroup:
    return RolloutGroup(rollout_id=f"L1/{name}", lease_id="L1", prompt_id=name,
                        generator_id="gen0", samples=samples, data_source="relay/arithmetic",
                        ground_truth=name.upper())


def make_run(run_dir: Path, *, rollout_log: bool = True) -> tuple[RolloutGroup, RolloutGroup]:
    """A run directory whose log holds two groups (the second's middle sample filtered out
    by the store) and step 3, served them in the order b, a, with importance weights."""
    run_dir.mkdir()
    (run_dir / "run.toml").write_text(f'[model]\npath = "builtin:tiny-arith"\n'
                                      f"[buffer]\nrollout_log = {str(rollout_log).lower()}\n")
    a = group("p-a", [sample(PROMPTS[0], "<answer>7</answer>", 1.0, [3]),
                      sample(PROMPTS[0], "<answer>8</answer>", 0.0, [2, 3])])
    b = group("p-b", [sample(PROMPTS[1], "<answer>7</answer>", 1.0, [4]),
                      sample(PROMPTS[1], "seven", 0.0, [4]),
                      sample(PROMPTS[1], "<answer>6</answer>", 0.0, [1])])
    log = RolloutLogWriter(run_dir / "rollouts")
    log.append(with_admission(a, Admission(kept_samples=(0, 1))))
    log.append(with_admission(b, Admission(kept_samples=(0, 2))))
    log.append_step(StepRecord(step=3, version=TRAINED_AT, rollout_ids=[b.rollout_id,
                                                                        a.rollout_id],
                               weights=[1.0, 0.5]))
    log.close()
    return a, b


def test_a_steps_groups_round_trip_through_the_jsonl_dump(tmp_path: Path) -> None:
    a, b = make_run(tmp_path / "run")
    out = tmp_path / "step3.jsonl"
    assert main([str(tmp_path / "run"), "--step", "3", "--jsonl", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["rollout_id"] for line in lines] == [b.rollout_id, a.rollout_id]
    assert [line["prompt"] for line in lines] == [PROMPTS[1], PROMPTS[0]]
    assert [line["importance_weight"] for line in lines] == [1.0, 0.5]
    assert {line["step"] for line in lines} == {3}
    assert {line["trained_at_version"] for line in lines} == {TRAINED_AT}
    assert [line["ground_truth"] for line in lines] == ["P-B", "P-A"]
    first, second = lines[0]["responses"], lines[1]["responses"]
    assert [r["text"] for r in first] == ["<answer>7</answer>", "<answer>6</answer>"]
    assert [r["reward"] for r in first] == [1.0, 0.0]
    assert [(r["version_min"], r["version_max"], r["staleness"]) for r in first] == [
        (4, 4, 0), (1, 1, 3)]
    assert [r["text"] for r in second] == ["<answer>7</answer>", "<answer>8</answer>"]
    assert [(r["version_min"], r["version_max"], r["staleness"]) for r in second] == [
        (3, 3, 1), (2, 3, 2)]
    assert second[0]["reward_info"] == {"format_ok": 1.0}


def test_a_step_prints_readably(tmp_path: Path, capsys) -> None:
    make_run(tmp_path / "run")
    assert main([str(tmp_path / "run"), "--step", "3"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"step 3: trained at weights version {TRAINED_AT}, 2 groups")
    assert f"prompt: {PROMPTS[1]}" in shown and "ground truth: 'P-B'" in shown
    assert "[2] reward 0  format_ok 1  version 2-3  staleness 2  stop" in shown
    assert "weight 0.5" in shown and "seven" not in shown  # the store filtered that one out


def test_a_step_not_recorded_is_exit_2_saying_which_are(tmp_path: Path, capsys) -> None:
    make_run(tmp_path / "run")
    assert main([str(tmp_path / "run"), "--step", "5"]) == 2
    assert "step 5 is not recorded (it records steps 3 to 3)" in capsys.readouterr().err


def test_a_run_without_its_rollout_log_is_exit_2_saying_why(tmp_path: Path, capsys) -> None:
    make_run(tmp_path / "off", rollout_log=False)
    assert main([str(tmp_path / "off"), "--step", "3"]) == 2
    assert "buffer.rollout_log = false" in capsys.readouterr().err


@pytest.mark.parametrize("cut", [1, 40])
def test_a_damaged_log_that_lost_the_steps_groups_is_exit_2_naming_the_damage(
        tmp_path: Path, capsys, cut: int) -> None:
    make_run(tmp_path / "run")
    segment = tmp_path / "run" / "rollouts" / "segment-000000.rlog"
    segment.write_bytes(segment.read_bytes()[:-cut])  # the last group's record is torn
    assert main([str(tmp_path / "run"), "--step", "3"]) == 2
    err = capsys.readouterr().err
    assert "1 of step 3's 2 groups are not in the log" in err
    assert f"the log is damaged: 1 unreadable record(s), the first in {segment} at byte" in err
