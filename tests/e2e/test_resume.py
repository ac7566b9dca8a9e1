"""Resume: a run killed with SIGKILL after a checkpoint and continued with ``--resume`` ends
with the weights of a run that was never interrupted.

Both runs are the embedded default's topology and run config with the end-to-end test's
small settings, a fixed seed and eta = 0 (``buffer.max_staleness=0``: synchronous, so each
step's batch is a function of the prompt stream and the weights). The killed run's
learner, buffer, generator and launcher all die at once; the resumed run reloads the
newest complete checkpoint, the buffer restarts its prompt stream from the checkpoint and
the generator reseeds its engine at each lease from the lease's first prompt id
(``relay.generators.process.lease_seed``).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import Metadata

from relay.buffer.prompt_source import PromptSource, write_buffer_checkpoint
from relay.buffer.rollout_log import read_rollout_log
from relay.configs import DEFAULT_RUN, DEFAULT_TOPOLOGY, ConfigError
from relay.configs.prompt_data import PromptDataset
from relay.launcher.plan import write_resolved
from relay.launcher.resolve import ResolvedLaunch, resolve_launch
from relay.learner.checkpoint_meta import FORMAT, META_FILE, CheckpointMeta, LoopState, scan_checkpoints
from relay.transport.messages import BufferCheckpoint

from .conftest import LAUNCHER, ROOT, launch, processes_mentioning, small_run_overrides

pytestmark = pytest.mark.e2e

STEPS, SAVE_FREQ = 6, 2


def overrides(model_dir: Path, run_root: Path) -> list[str]:
    return small_run_overrides(model_dir, run_root, steps=STEPS) + [
        "buffer.max_staleness=0", "trainer.seed=3", "data.seed=3",
        f"trainer.save_freq={SAVE_FREQ}", "checkpoint.keep_last=5", "trainer.test_freq=-1",
        "trainer.val_before_train=false"]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step-{STEPS}" / "hf" / "model.safetensors")


def wait_for_run_dir(run_root: Path, timeout_s: float = 120) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = [p for p in run_root.iterdir() if (p / "logs").is_dir()]
        if runs:
            return runs[0]
        time.sleep(0.05)
    raise AssertionError(f"no run directory appeared in {run_root}")


def kill_after_first_checkpoint(launcher: subprocess.Popen, run_dir: Path,
                                timeout_s: float = 240) -> Path:
    """SIGKILL the launcher and every process of its run once a checkpoint is complete; the
    newest complete checkpoint once all are dead."""
    deadline = time.monotonic() + timeout_s
    checkpoint = None
    while checkpoint is None and time.monotonic() < deadline:
        assert launcher.poll() is None, launcher.communicate()[0]
        complete, _incomplete = scan_checkpoints(run_dir / "checkpoints")
        checkpoint = complete[-1][1] if complete else None
        time.sleep(0.02)
    assert checkpoint is not None, "no checkpoint was completed"
    launcher.kill()
    for line in processes_mentioning(str(run_dir)):
        try:
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass  # it died with its parent
    launcher.wait()
    deadline = time.monotonic() + 30
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(str(run_dir)) == []
    complete, _incomplete = scan_checkpoints(run_dir / "checkpoints")
    return complete[-1][1]  # the learner may have completed another before it was killed


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_uninterrupted_weights(random_model_dir: Path,
                                                             tmp_path: Path) -> None:
    uninterrupted_root, killed_root = tmp_path / "uninterrupted", tmp_path / "killed"
    uninterrupted_root.mkdir()
    killed_root.mkdir()
    result = launch(overrides(random_model_dir, uninterrupted_root))
    assert result.returncode == 0, result.stdout + result.stderr
    (uninterrupted,) = uninterrupted_root.iterdir()

    launcher = subprocess.Popen([sys.executable, str(LAUNCHER),
                                 *overrides(random_model_dir, killed_root)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=ROOT)
    run_dir = wait_for_run_dir(killed_root)
    checkpoint = kill_after_first_checkpoint(launcher, run_dir)
    assert not (run_dir / "checkpoints" / f"step-{STEPS}").exists(), "killed too late"

    resumed = launch(["--resume", str(run_dir)])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming from {checkpoint}" in resumed.stdout
    assert processes_mentioning(str(run_dir)) == []

    want, got = final_weights(uninterrupted), final_weights(run_dir)
    assert want.keys() == got.keys()
    worst = max(float((want[k] - got[k]).abs().max()) for k in want)
    assert worst <= 1e-6, f"largest difference {worst}"
    moved = load_file(random_model_dir / "model.safetensors")
    assert all(not torch.equal(moved[k], got[k]) for k in got)

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    steps = {m.step for m in client.get_metric_history(run.info.run_id, "rollout/reward_mean")}
    assert steps == set(range(1, STEPS + 1))
    assert run.info.status == "FINISHED"
    assert run.data.tags["relay.resumed_at_step"] == checkpoint.name.removeprefix("step-")


def write_checkpoint_files(folder: Path, step: int) -> None:
    """What the launcher reads of a checkpoint: ``meta.json``, the buffer's state and the
    DCP metadata (here of no tensors)."""
    folder.mkdir(parents=True)
    source = PromptSource(PromptDataset([]), shuffle=False)
    write_buffer_checkpoint(folder, BufferCheckpoint(step=step, source=source.state()))
    meta = CheckpointMeta(format=FORMAT, loop=LoopState(step=step, version=step),
                          steps_done=step, world_size=1, parts=["policy"],
                          schedulers={"policy": {}})
    (folder / META_FILE).write_bytes(msgspec.json.encode(meta))
    (folder / "dcp").mkdir()
    (folder / "dcp" / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))


def resolve(model_dir: Path, run_root: Path, *extra: str) -> ResolvedLaunch:
    """What ``tools/launch-cluster.py`` resolves for the small run with ``extra`` overrides."""
    args = [*small_run_overrides(model_dir, run_root, steps=4), *extra]
    return resolve_launch(str(DEFAULT_TOPOLOGY), str(DEFAULT_RUN),
                          [a.removeprefix("topology.") for a in args
                           if a.startswith("topology.")],
                          [a for a in args if not a.startswith("topology.")])


def test_verl_resume_keys_are_decided_before_launch(random_model_dir: Path,
                                                    tmp_path: Path) -> None:
    shared = tmp_path / "shared"  # a checkpoint.dir that outlives run directories
    write_checkpoint_files(shared / "step-2", step=2)
    write_checkpoint_files(shared / "step-4", step=4)
    (shared / "step-6.tmp").mkdir()

    def trainer(*extra: str) -> tuple[str, str]:
        decided = resolve(random_model_dir, tmp_path / "runs", *extra).run.trainer
        return decided.resume_mode, decided.resume_from_path

    assert trainer() == ("disable", "")  # auto, and a fresh run directory has no checkpoint
    assert trainer(f"checkpoint.dir={shared}") == ("resume_path", str(shared / "step-4"))
    assert trainer(f"checkpoint.dir={shared}", "trainer.resume_mode=disable") == ("disable", "")
    assert trainer("trainer.resume_mode=resume_path",
                   f"trainer.resume_from_path={shared / 'step-2'}") == (
        "resume_path", str(shared / "step-2"))
    for extra, problem in [
            (["trainer.resume_mode=resume_path"], "trainer.resume_from_path: is empty"),
            ([f"trainer.resume_from_path={shared / 'step-2'}"], "resume_mode is 'auto'"),
            (["trainer.resume_mode=resume_path", f"trainer.resume_from_path={shared}/step-6.tmp"],
             "step-6.tmp: incomplete"),
            (["trainer.resume_mode=resume_path", f"trainer.resume_from_path={shared}/step-8"],
             "step-8: no such checkpoint folder")]:
        with pytest.raises(ConfigError, match=problem):
            trainer(*extra)


def test_resume_refuses_what_it_cannot_resume(random_model_dir: Path, tmp_path: Path) -> None:
    not_a_run = launch(["--resume", str(tmp_path)])
    assert not_a_run.returncode == 2
    assert "not a run directory" in not_a_run.stderr

    resolved = resolve(random_model_dir, tmp_path)
    write_resolved(resolved.topology, resolved.run, resolved.run_dir)
    checkpoints = resolved.run_dir / "checkpoints"
    write_checkpoint_files(checkpoints / "step-2", step=2)
    planned = launch(["--resume", str(resolved.run_dir), "--dry-run"])
    assert planned.returncode == 0, planned.stderr
    assert f"# Resuming from: {checkpoints / 'step-2'}" in planned.stdout

    other_algorithm = launch(["--resume", str(resolved.run_dir), "algorithm.adv_estimator=gae"])
    assert other_algorithm.returncode == 2
    assert "holds policy but this run trains policy, critic" in other_algorithm.stderr

    (checkpoints / "step-2").rename(checkpoints / "step-2.tmp")  # as if killed mid-write
    nothing = launch(["--resume", str(resolved.run_dir)])
    assert nothing.returncode == 2
    assert "no complete checkpoint" in nothing.stderr and "step-2.tmp" in nothing.stderr


def ground_truths(run_dir: Path) -> dict[str, set]:
    """Each prompt id of the run's rollout log with the ground truths logged under it."""
    seen: dict[str, set] = {}
    for group in read_rollout_log(run_dir / "rollouts"):
        seen.setdefault(group.prompt_id, set()).add(group.ground_truth)
    return seen


@pytest.mark.slow
def test_a_resume_under_another_batch_size_or_other_rows_is_refused_unless_allowed(
        random_model_dir: Path, tmp_path: Path) -> None:
    """The issue's two failures. After 2 steps of 4 groups, data.train_batch_size=2 is
    refused at launch naming the key; allowed, the run trains on (the gate counted 8
    groups, which at 2 per step would have held every lease back for good). Then 5 other
    training rows: refused; allowed, the run trains on them as epoch 1 after the prompts
    not trained on (the saved stream stood past row 5: torchdata's restore raised a bare
    StopIteration), and no prompt id names two rows."""
    other = tmp_path / "other.jsonl"
    rows = (ROOT / "configs/data/arithmetic-train.jsonl").read_text().splitlines()[-5:]
    other.write_text("\n".join(rows) + "\n")
    first = launch(small_run_overrides(random_model_dir, tmp_path / "runs", steps=2) + [
        "buffer.max_staleness=0", "trainer.save_freq=2", "trainer.test_freq=-1",
        "trainer.val_before_train=false"])
    assert first.returncode == 0, first.stdout + first.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()

    smaller = ["--resume", str(run_dir), "data.train_batch_size=2",
               "trainer.total_training_steps=4", "trainer.progress_timeout_s=120"]
    refused = launch(smaller)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "data.train_batch_size: 4 in the checkpoint, 2 now" in refused.stderr
    assert "trainer.resume_allow_changes=data.train_batch_size " in refused.stderr
    assert not (run_dir / "checkpoints" / "step-4").exists()
    allowed = launch([*smaller, "trainer.resume_allow_changes=data.train_batch_size"])
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert (run_dir / "checkpoints" / "step-4").is_dir()
    assert ("resuming under a changed config (allowed at launch): data.train_batch_size: 4 "
            "in the checkpoint, 2 now") in (run_dir / "logs" / "buffer.log").read_text()

    other_rows = ["--resume", str(run_dir), f"data.train_files={other}",
                  "trainer.total_training_steps=6", "trainer.progress_timeout_s=120"]
    refused = launch([*other_rows, "data.train_batch_size=1"])
    assert refused.returncode == 2, refused.stdout + refused.stderr
    # the last launch's allowance of data.train_batch_size does not carry over
    assert "data.train_files, data.train_batch_size: resuming from" in refused.stderr
    assert "data.train_batch_size: 2 in the checkpoint, 1 now" in refused.stderr
    allowed = launch([*other_rows, "data.train_batch_size=2",
                      "trainer.resume_allow_changes=data.train_files"])
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert (run_dir / "checkpoints" / "step-6").is_dir()

    seen = ground_truths(run_dir)
    assert all(len(truths) == 1 for truths in seen.values()), seen  # one row per id
    new_rows = {pid: truths for pid, truths in seen.items() if pid.startswith("e1-")}
    assert new_rows, sorted(seen)
    expected = [msgspec.json.decode(row)["reward_model"]["ground_truth"] for row in rows]
    for prompt_id, truths in new_rows.items():
        assert truths == {expected[int(prompt_id.removeprefix("e1-"))]}
