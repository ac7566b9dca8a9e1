"""verl's ``trainer.rollout_data_dir`` dump (``relay.buffer.rollout_dump``): the hub writes
each served step's samples as ``DIR/STEP.jsonl`` with verl's fields; a failed write is
counted and the run goes on; the run's tokenizer decodes."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import torch

from relay.buffer.rollout_dump import RolloutDump, dump_rows, rollout_dump
from relay.configs.run_schema import DataConfig, ModelConfig, RunConfig, TrainerConfig
from relay.learner.tiny_model.tokenizer import build_tokenizer
from relay.transport.messages import Prompt, SampleRequest, VersionUpdate

from .conftest import make_group
from .test_hub import answer, lease


def decode(ids) -> str:
    return " ".join(map(str, ids.tolist()))


def test_each_served_step_is_dumped_as_verls_jsonl(make_hub, tmp_path: Path) -> None:
    hub = make_hub(batch_size=2, n=2, per_lease=4, max_staleness=1)
    hub.dump = RolloutDump(folder=tmp_path / "dump", decode=decode)
    answer(hub, lease(hub))
    hub.handle(VersionUpdate(version=1, step=1))
    served = hub.handle(SampleRequest(num_groups=2, step=2))
    lines = [json.loads(line)
             for line in (tmp_path / "dump" / "2.jsonl").read_text().splitlines()]
    assert lines == [{"input": "1 2 3", "output": "4 5 6", "gts": g.ground_truth,
                      "score": s.reward, "step": 2}
                     for g in served.groups for s in g.samples]
    assert len(lines) == 4 and sorted(p.name for p in (tmp_path / "dump").iterdir()) == [
        "2.jsonl"]


def test_a_step_the_learner_does_not_name_is_not_dumped(make_hub, tmp_path: Path) -> None:
    hub = make_hub(batch_size=2, per_lease=4, max_staleness=1)
    hub.dump = RolloutDump(folder=tmp_path / "dump", decode=decode)
    answer(hub, lease(hub))
    hub.handle(SampleRequest(num_groups=2))
    assert not (tmp_path / "dump").exists()


def test_a_failed_write_is_counted_and_the_batch_still_served(make_hub, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    hub = make_hub(batch_size=2, per_lease=4, max_staleness=1)
    hub.dump = RolloutDump(folder=tmp_path / "a-file" / "dump", decode=decode)
    answer(hub, lease(hub))
    served = hub.handle(SampleRequest(num_groups=2, step=1))
    assert len(served.groups) == 2
    assert hub.counts["rollout_dump/write_errors"] == 1


def test_only_the_reward_extras_every_sample_has_become_columns() -> None:
    group = make_group("L1", Prompt(prompt_id="p", messages=[], data_source="d"), 2)
    first, second = group.samples
    group = msgspec.structs.replace(group, ground_truth="42", samples=[
        msgspec.structs.replace(first, reward_info={"acc": 1.0, "format_ok": 1.0}),
        msgspec.structs.replace(second, reward_info={"acc": 0.0})])
    rows = dump_rows(7, [group], decode)
    assert rows == [{"input": "1 2 3", "output": "4 5 6", "gts": "42", "score": 1.0,
                     "step": 7, "acc": 1.0},
                    {"input": "1 2 3", "output": "4 5 6", "gts": "42", "score": 1.0,
                     "step": 7, "acc": 0.0}]


def test_the_runs_tokenizer_decodes_without_special_tokens(tmp_path: Path) -> None:
    """``model.path``'s tokenizer: a ``builtin:`` model's folder, as the launcher points it."""
    build_tokenizer().save_pretrained(str(tmp_path / "model"))
    run = RunConfig(data=DataConfig(train_files=[]),
                    model=ModelConfig(path=str(tmp_path / "model")),
                    trainer=TrainerConfig(rollout_data_dir=str(tmp_path / "dump")))
    dump = rollout_dump(run)
    assert dump is not None and dump.folder == tmp_path / "dump"
    ids = build_tokenizer().encode("<|im_start|>user\nWhat is 2 + 2?<|im_end|>")
    assert dump.decode(torch.tensor(ids)) == "user\nWhat is 2 + 2?"
    assert rollout_dump(msgspec.structs.replace(run, trainer=TrainerConfig())) is None

