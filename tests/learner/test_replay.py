"""The offline replay's pieces: served groups, recorded steps, the starting checkpoint, the
comparison, and the replayed learner's optimizer, which follows the run config's edits. The
whole tool runs end to end in tests/e2e/test_replay.py."""

from __future__ import annotations

import pickle
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from relay.buffer.hub import with_admission
from relay.buffer.rollout_log import RolloutLogWriter, StepRecord
from relay.buffer.store import Admission
from relay.configs.run_schema import (
    ActorConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainerConfig,
)
from relay.configs.rundir import RunContext
from relay.configs.topology_schema import Topology
from relay.generators.torch_engine import TorchEngine
from relay.learner.batch import collate
from relay.learner.checkpoint import CheckpointError, save_checkpoint
from relay.learner.checkpoint_meta import FORMAT, META_FILE, CheckpointMeta, Lineage, LoopState
from relay.learner.main import build_learner
from relay.learner.replay import (
    Replayer,
    ReplayError,
    StepComparison,
    recorded_steps,
    served_group,
    starting_checkpoint,
)
from relay.transport.messages import Prompt
from tests.buffer.conftest import make_group

from ..conftest import free_port
from .test_checkpoint import forge
from .test_safe_dcp import Payload
from .test_update import PROMPTS, rollouts


def group(name: str, rewards: list[float]):
    return make_group("L1", Prompt(prompt_id=name, messages=[], data_source="d"), len(rewards),
                      rewards=rewards)


def test_a_served_group_holds_the_samples_the_store_kept() -> None:
    logged = with_admission(group("p", [0.0, 1.0, 0.5]), Admission(kept_samples=(0, 2)))
    served = served_group(logged)
    assert [s.reward for s in served.samples] == [0.0, 0.5]
    assert "buffer_admission" not in served.metadata


def test_recorded_steps_bring_their_groups_in_order(tmp_path: Path) -> None:
    log = RolloutLogWriter(tmp_path)
    a, b = group("a", [1.0, 0.0]), group("b", [0.0, 1.0])
    for g in (a, b):
        log.append(with_admission(g, Admission(kept_samples=(0, 1))))
    log.append_step(StepRecord(step=1, version=0, rollout_ids=[b.rollout_id, a.rollout_id]))
    log.close()
    (step,) = recorded_steps(tmp_path, 1, 0)
    assert [g.rollout_id for g in step.groups] == [b.rollout_id, a.rollout_id]
    with pytest.raises(ReplayError, match="no record of step"):
        recorded_steps(tmp_path, 1, 2)


def test_a_group_missing_from_the_log_is_named(tmp_path: Path) -> None:
    log = RolloutLogWriter(tmp_path)
    log.append(group("a", [1.0, 0.0]))
    log.append_step(StepRecord(step=1, version=0, rollout_ids=["L1/gone"]))
    log.close()
    with pytest.raises(ReplayError, match="L1/gone"):
        recorded_steps(tmp_path, 1, 1)


def checkpoint(folder: Path, step: int) -> None:
    path = folder / f"step-{step}"
    path.mkdir(parents=True)
    meta = CheckpointMeta(format=FORMAT, loop=LoopState(step=step, version=step),
                          steps_done=step, world_size=1, parts=["policy"],
                          schedulers={"policy": {}})
    (path / META_FILE).write_bytes(msgspec.json.encode(meta))
    (path / "dcp").mkdir()
    (path / "dcp" / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))


def test_the_replay_starts_from_the_newest_checkpoint_before_the_first_step(tmp_path) -> None:
    for step in (2, 4, 6):
        checkpoint(tmp_path, step)
    (tmp_path / "step-5.tmp").mkdir()  # incomplete: never chosen
    assert starting_checkpoint(tmp_path, 5) == (4, tmp_path / "step-4")
    assert starting_checkpoint(tmp_path, 4) == (2, tmp_path / "step-2")
    assert starting_checkpoint(tmp_path, 2) == (0, None)


def test_the_replay_skips_a_checkpoint_it_cannot_trust_for_the_one_before(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for step in (2, 4, 6):
        checkpoint(tmp_path, step)
    marker = tmp_path / "ran"
    (tmp_path / "step-4" / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    (tmp_path / "step-6").chmod(0o777)
    assert starting_checkpoint(tmp_path, 7) == (2, tmp_path / "step-2")
    assert f"skipping {tmp_path / 'step-6'}: {tmp_path / 'step-6'}: writable by" in caplog.text
    assert (f"skipping {tmp_path / 'step-4'}: {tmp_path / 'step-4' / 'dcp' / '.metadata'}: "
            "refused: it asks to build tests.learner.test_safe_dcp.write_marker") in caplog.text
    assert not marker.exists()


def test_the_comparison_is_relative_and_absolute_near_zero() -> None:
    same = StepComparison(step=1, replayed={"actor/loss": 2e-8}, live={"actor/loss": -3e-8})
    assert same.worst_relative_difference() < 1e-4
    off = StepComparison(step=1, replayed={"actor/grad_norm": 1.1}, live={"actor/grad_norm": 1.0})
    assert off.worst_relative_difference() == pytest.approx(0.1)
    unlogged = StepComparison(step=1, replayed={"actor/loss": 1.0},
                              live={"actor/loss": float("nan")})
    assert unlogged.worst_relative_difference() == 0.0


def run_context(model_dir: Path, run_dir: Path, lr: float) -> RunContext:
    """A run of the model at ``model_dir`` with a 3-step warm-up to ``lr``."""
    run = RunConfig(data=DataConfig(train_files=[], train_batch_size=len(PROMPTS)),
                    model=ModelConfig(path=str(model_dir), dtype="float32"),
                    actor=ActorConfig(optim=OptimConfig(lr=lr, weight_decay=0.0,
                                                        lr_warmup_steps=3)),
                    trainer=TrainerConfig(total_training_steps=10))
    return RunContext(run_dir=run_dir, topology=Topology(), run=run)


def test_a_replay_with_an_edited_learning_rate_trains_with_it(random_model_dir: Path,
                                                               tmp_path: Path) -> None:
    """The README's recipe: edit run.toml's lr and replay from a checkpoint."""
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32,
                                         eos_ids=[2], pad_id=0, seed=5)
    batch = collate(rollouts(engine, 0), pad_id=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:  # the live run: lr 1e-3, a checkpoint after step 1
        live = build_learner(run_context(random_model_dir, tmp_path, 1e-3), torch.device("cpu"))
        live.step(batch)
        folder = save_checkpoint(live, tmp_path / "checkpoints", LoopState(step=1, version=1),
                                 lineage=Lineage(id="live"), keep_last=1)
    finally:
        dist.destroy_process_group()

    replayer = Replayer(run_context(random_model_dir, tmp_path, 4e-4), folder)
    try:
        learner = replayer.learner
        assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(4e-4 / 3)  # s = 1 of 3
        assert learner.scheduler.get_last_lr() == [learner.optimizer.param_groups[0]["lr"]]
        assert learner.step(batch).metrics["actor/lr"] == pytest.approx(4e-4 * 2 / 3)
    finally:
        replayer.close()


def test_a_replay_refuses_a_checkpoint_whose_metadata_asks_to_run_code(
        random_model_dir: Path, tmp_path: Path) -> None:
    """``tools/replay-rollouts.py`` ends with this error (exit code 2): nothing ran."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        live = build_learner(run_context(random_model_dir, tmp_path, 1e-3), torch.device("cpu"))
        folder = save_checkpoint(live, tmp_path / "checkpoints", LoopState(step=1, version=1),
                                 lineage=Lineage(id="live"), keep_last=1)
    finally:
        dist.destroy_process_group()
    marker = tmp_path / "ran"
    forge(folder, "dcp/.metadata", pickle.dumps(Payload(marker)))  # with its manifest
    with pytest.raises(CheckpointError, match=r"dcp/\.metadata: refused: it asks to build "
                                              r"tests\.learner\.test_safe_dcp\.write_marker"):
        Replayer(run_context(random_model_dir, tmp_path, 1e-3), folder)
    assert not marker.exists()
    assert not dist.is_initialized()  # the refused replay left no process group behind
