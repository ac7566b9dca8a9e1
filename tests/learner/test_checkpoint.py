"""Checkpoints: written atomically (a folder is complete only once renamed, with its
``meta.json``), found newest-complete-first with incomplete ones skipped by name, pruned to
``keep_last`` complete ones of the run's own lineage (a branch or another run in the same
folder keeps its checkpoints; leftovers of interrupted saves go), verified before a resume
(a flipped byte, a metadata pickle that would run code, a folder others can write: each
refused naming it, and ``auto`` falls back to the newest intact one), and read back whole: a
learner resumed from a checkpoint takes the same next step as the learner that wrote it, and
one written by two ranks, or by four hybrid-sharded as 2 x 2 (HSDP's 2-D shards), loads at
one and at the layout that wrote it."""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import stat
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relay.algorithms.kl import KLControlConfig
from relay.buffer.prompt_source import BUFFER_CHECKPOINT_FILE, read_buffer_checkpoint
from relay.configs.run_schema import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    PrmModelConfig,
    RewardModelConfig,
    RunConfig,
)
from relay.generators.torch_engine import TorchEngine
from relay.learner import checkpoint as checkpoints
from relay.learner.batch import TrainBatch, collate
from relay.learner.checkpoint import (
    CheckpointError,
    LoopState,
    check_resumable,
    load_checkpoint,
    resumable_checkpoint,
    save_checkpoint,
)
from relay.learner.checkpoint_files import digest_file
from relay.learner.checkpoint_lineage import (
    continued_lineage,
    overwritten_checkpoints,
    run_lineage,
)
from relay.learner.checkpoint_meta import META_FILE, Branch, Lineage, latest_checkpoint, read_meta
from relay.learner.critic import Critic
from relay.learner.implicit_prm import ImplicitPRM
from relay.learner.update import Learner
from relay.transport.messages import BufferCheckpoint, Prompt, PromptSourceState

from ..conftest import exit_worker, free_port, gather_full_weights, save_random_model
from .test_safe_dcp import Payload
from .test_update import rollouts
from .test_update_algorithms import make_learner

pytestmark = pytest.mark.usefixtures("one_rank_group")

# a schedule that moves every step and an adaptive KL controller: state a resume must keep
ACTOR = ActorConfig(optim=OptimConfig(lr=1e-3, weight_decay=0.0, warmup_style="cosine",
                                      lr_warmup_steps=3))
KL_IN_REWARD = AlgorithmConfig(use_kl_in_reward=True,
                               kl_ctrl=KLControlConfig(type="adaptive", kl_coef=0.05,
                                                       horizon=10, target_kl=0.01))
BUFFER = BufferCheckpoint(step=2, accepted=8, source=PromptSourceState(
    epoch=1, loader={"_num_yielded": 3, "generator": torch.arange(8, dtype=torch.uint8)},
    pending=[Prompt(prompt_id="e1-4", messages=[{"role": "user", "content": "1 + 1?"}],
                    data_source="arithmetic", ground_truth="2")]))


@pytest.fixture(scope="module")
def batches(random_model_dir: Path) -> list[TrainBatch]:
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32,
                                         eos_ids=[2], pad_id=0, seed=5)
    return [collate(rollouts(engine, step), pad_id=0) for step in range(3)]


@pytest.fixture
def one_thread():
    """One intra-op thread: CPU kernels then sum in a fixed order, so two equal steps give
    bitwise equal weights (with more threads a busy machine may change the order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in gather_full_weights(model, torch.float32).items()}


def moments(learner: Learner) -> list[torch.Tensor]:
    return [s["exp_avg"].full_tensor().clone() for s in learner.optimizer.state.values()]


RUN = Lineage(id="run")  # the lineage of these tests' saves, unless they say otherwise


def save(learner: Learner, folder: Path, step: int, keep_last: int = 2,
         lineage: Lineage = RUN) -> Path:
    return save_checkpoint(learner, folder, LoopState(step=step, version=step),
                           lineage=lineage, keep_last=keep_last, buffer=BUFFER,
                           mlflow_run_id="run-1")


@pytest.mark.usefixtures("one_thread")
def test_a_resumed_learner_takes_the_same_next_step(random_model_dir: Path, tmp_path: Path,
                                                     batches: list[TrainBatch]) -> None:
    torch.manual_seed(11)
    random.seed(11)
    trained = make_learner(random_model_dir, actor=ACTOR, algorithm=KL_IN_REWARD)
    for batch in batches[:2]:
        trained.step(batch)
    folder = save_checkpoint(trained, tmp_path, LoopState(step=2, version=2,
                                                          unpublished_update=True),
                             lineage=RUN, keep_last=2, buffer=BUFFER, mlflow_run_id="run-1")
    draws = (torch.rand(3), random.random())
    saved_weights, saved_moments = full_weights(trained.model), moments(trained)
    saved_lr, saved_kl = trained.scheduler.get_last_lr(), trained.kl_ctrl.value
    uninterrupted = trained.step(batches[2])

    torch.manual_seed(99)  # a fresh process: other random states
    random.seed(99)
    resumed = make_learner(random_model_dir, actor=ACTOR, algorithm=KL_IN_REWARD)
    meta = load_checkpoint(resumed, folder)
    assert meta.loop == LoopState(step=2, version=2, unpublished_update=True)
    assert meta.mlflow_run_id == "run-1" and meta.parts == ["policy"]
    assert torch.equal(torch.rand(3), draws[0]) and random.random() == draws[1]  # RNG states
    loaded = full_weights(resumed.model)
    assert all(torch.equal(loaded[k], saved_weights[k]) for k in saved_weights)
    assert all(torch.equal(a, b) for a, b in zip(moments(resumed), saved_moments, strict=True))
    assert resumed.scheduler.get_last_lr() == saved_lr != [1e-3]
    assert resumed.kl_ctrl.value == saved_kl != 0.05
    assert resumed.steps_done == 2
    assert read_buffer_checkpoint(folder).source.pending[0].prompt_id == "e1-4"

    again = resumed.step(batches[2])
    assert again.metrics == uninterrupted.metrics
    after = full_weights(resumed.model)
    assert all(torch.equal(after[k], v) for k, v in full_weights(trained.model).items())


# the same schedule at half the rate, other betas and a weight decay: a user's run.toml edit
EDITED = ActorConfig(optim=OptimConfig(lr=5e-4, betas=[0.8, 0.99], weight_decay=0.1,
                                       warmup_style="cosine", lr_warmup_steps=3))


@pytest.mark.usefixtures("one_thread")
def test_a_resumed_learner_trains_with_the_configs_learning_rate_betas_and_weight_decay(
        random_model_dir: Path, tmp_path: Path, batches: list[TrainBatch],
        caplog: pytest.LogCaptureFixture) -> None:
    trained = make_learner(random_model_dir, actor=ACTOR)
    for batch in batches[:2]:
        trained.step(batch)
    folder = save(trained, tmp_path, step=2)

    with caplog.at_level(logging.INFO, logger="relay.learner.checkpoint"):
        resumed = make_learner(random_model_dir, actor=EDITED)
        load_checkpoint(resumed, folder)
    # step 2 of a 3-step warm-up: 2/3 of the config's rate, not of the checkpoint's 1e-3
    group = resumed.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(5e-4 * 2 / 3) and group["initial_lr"] == 5e-4
    assert tuple(group["betas"]) == (0.8, 0.99) and group["weight_decay"] == 0.1
    assert resumed.scheduler.base_lrs == [5e-4]
    assert resumed.scheduler.get_last_lr() == [group["lr"]]
    assert resumed.scheduler.last_epoch == trained.scheduler.last_epoch == 2  # its step kept
    changed = [r.getMessage() for r in caplog.records if "in the checkpoint" in r.getMessage()]
    assert changed == [
        f"{folder}: actor.optim.lr: 0.001 in the checkpoint, 0.0005 in the config: using the "
        "config's",
        f"{folder}: actor.optim.betas: [0.9, 0.999] in the checkpoint, [0.8, 0.99] in the "
        "config: using the config's",
        f"{folder}: actor.optim.weight_decay: 0.0 in the checkpoint, 0.1 in the config: using "
        "the config's"]

    # it steps as the checkpoint's learner would with those values set by hand
    by_hand = make_learner(random_model_dir, actor=ACTOR)
    load_checkpoint(by_hand, folder)
    by_hand.optimizer.param_groups[0].update(lr=5e-4 * 2 / 3, betas=(0.8, 0.99),
                                             weight_decay=0.1)
    assert resumed.step(batches[2]).metrics["actor/lr"] == pytest.approx(5e-4)  # s = 3: cosine
    by_hand.step(batches[2])
    after, expected = full_weights(resumed.model), full_weights(by_hand.model)
    assert all(torch.equal(after[k], expected[k]) for k in expected)
    unchanged = make_learner(random_model_dir, actor=ACTOR)
    load_checkpoint(unchanged, folder)
    unchanged.step(batches[2])
    assert any(not torch.equal(after[k], v) for k, v in full_weights(unchanged.model).items())


def test_a_checkpoint_is_complete_only_once_renamed(random_model_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    learner = make_learner(random_model_dir)
    save(learner, tmp_path, step=1)

    def crash(_folder: Path) -> None:  # everything is written but meta.json
        raise OSError("disk full")

    with monkeypatch.context() as patched:
        patched.setattr(checkpoints, "fsync_tree", crash)
        with pytest.raises(OSError):
            save(learner, tmp_path, step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2.tmp"]
    assert sorted(p.name for p in (tmp_path / "step-2.tmp").iterdir()) == [
        BUFFER_CHECKPOINT_FILE, "dcp", "hf", "rng"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1"

    save(learner, tmp_path, step=2)  # the same step again: the leftover is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]
    assert not list(tmp_path.rglob("*.partial"))
    assert sorted(p.name for p in (tmp_path / "step-2").iterdir()) == [
        BUFFER_CHECKPOINT_FILE, "dcp", "hf", "meta.json", "rng"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-2"


def test_incomplete_checkpoints_are_skipped_by_name(random_model_dir: Path, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    learner = make_learner(random_model_dir)
    good = save(learner, tmp_path, step=2, keep_last=5)
    for name in ("step-3.tmp", "step-4", "step-5", "step-6"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-5" / "meta.json").write_text(json.dumps({"step": 5, "version": 5}))
    (tmp_path / "step-6" / "meta.json").write_text("{\"format\": 1, \"loop\": ")  # torn
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path) == good
    skipped = caplog.text
    assert "step-3.tmp: incomplete, its writing did not finish" in skipped
    assert "step-4: incomplete, no meta.json" in skipped
    assert "step-5/meta.json: written by another version of Relay" in skipped
    assert "step-6/meta.json: unreadable" in skipped
    assert latest_checkpoint(tmp_path / "nothing-here") is None


def test_keep_last_counts_this_lineages_checkpoints_and_spares_every_other_lineages(
        random_model_dir: Path, tmp_path: Path) -> None:
    learner = make_learner(random_model_dir)
    (tmp_path / "step-0.tmp").mkdir(parents=True)  # names no writer, older than any save
    for step in (1, 2, 3, 4):
        save(learner, tmp_path, step=step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-4"]
    save(learner, tmp_path, step=3, keep_last=2)  # this lineage went back: its step 4 goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]

    # a branch (another lineage) in the same folder: before lineages, saving its step 2
    # removed step-3, a later step of whichever run
    branch = Lineage(id="branch", parent=Branch(lineage=RUN.id, step=1, path="step-1"))
    ours = (tmp_path / "step-3" / "meta.json").read_bytes()
    for step in (1, 2, 5, 6):
        save(learner, tmp_path, step=step, keep_last=2, lineage=branch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-5", "step-6"]
    assert (tmp_path / "step-3" / "meta.json").read_bytes() == ours
    assert read_meta(tmp_path / "step-6").lineage == branch

    # it never writes over the other lineage's step, and leaves nothing behind trying
    with pytest.raises(CheckpointError, match=r"step-3: holds another run's checkpoint "
                                              r"\(lineage run\); this run \(lineage branch\)"):
        save(learner, tmp_path, step=3, lineage=branch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-5", "step-6"]
    assert (tmp_path / "step-3" / "meta.json").read_bytes() == ours


GRPO_RUN = RunConfig(data=DataConfig(train_files=[]), model=ModelConfig(path="unused"))


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_branch_keeps_the_later_checkpoints_of_the_run_it_branched_from(
        random_model_dir: Path, tmp_path: Path) -> None:
    """The issue's case: resume_from_path=step-50 while step-60 exists. Before lineages the
    branch's first save removed step-60."""
    learner = make_learner(random_model_dir)
    for step in (50, 60):
        save(learner, tmp_path, step=step, keep_last=5)
    branch = run_lineage(tmp_path, tmp_path / "step-50")
    assert branch.id != RUN.id
    assert branch.parent == Branch(lineage=RUN.id, step=50, path=str(tmp_path / "step-50"))
    save(learner, tmp_path, step=51, keep_last=1, lineage=branch)
    assert names(tmp_path) == ["step-50", "step-51", "step-60"]
    assert read_meta(tmp_path / "step-60").lineage == RUN

    # the launcher refuses the branch if it would save where step-60 lies
    assert overwritten_checkpoints(tmp_path, continued_lineage(tmp_path, tmp_path / "step-50"),
                                   [55, 60]) == [(tmp_path / "step-60", "lineage run")]
    # resuming from the newest continues the lineage; so does resuming past a damaged later
    # checkpoint, which the run's own save then replaces
    assert run_lineage(tmp_path, tmp_path / "step-60") == RUN
    flip_a_byte(tmp_path / "step-60")
    assert continued_lineage(tmp_path, tmp_path / "step-50") == RUN


def flip_a_byte(checkpoint: Path) -> Path:
    """Flip one bit in the middle of the checkpoint's largest DCP shard; that shard."""
    shard = max((checkpoint / "dcp").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard


def test_a_damaged_newest_checkpoint_is_named_and_auto_resumes_from_the_one_before(
        random_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    learner = make_learner(random_model_dir)
    for step in (1, 2):
        save(learner, tmp_path, step=step)
    meta = check_resumable(tmp_path / "step-2", GRPO_RUN)
    assert {"meta.json", "writer.json"}.isdisjoint(meta.files)
    assert {"buffer.rec", "dcp/.metadata", "hf/model.safetensors",
            "rng/rank-0.json"} <= set(meta.files)
    shard = flip_a_byte(tmp_path / "step-2")
    with pytest.raises(CheckpointError, match=re.escape(
            f"{shard}: its SHA-256 differs from the one {tmp_path / 'step-2'}'s meta.json "
            "recorded: the checkpoint is damaged")):
        check_resumable(tmp_path / "step-2", GRPO_RUN)
    with caplog.at_level(logging.WARNING, logger="relay.learner.checkpoint"):
        assert resumable_checkpoint(tmp_path, GRPO_RUN) == tmp_path / "step-1"
    assert f"skipping {tmp_path / 'step-2'}: {shard}: its SHA-256 differs" in caplog.text
    assert (f"resuming from {tmp_path / 'step-1'}, the newest valid checkpoint: the newer "
            "step-2 cannot be resumed") in caplog.text

    # a cut shard fails to load: the error names it, not the model
    shard.write_bytes(shard.read_bytes()[:-64])
    with pytest.raises(CheckpointError, match=re.escape(f"{shard}: ")
                       + r"\d+ bytes, but .*meta\.json recorded \d+: the checkpoint is damaged"):
        load_checkpoint(make_learner(random_model_dir), tmp_path / "step-2")


def test_leftovers_of_interrupted_saves_are_pruned_but_another_runs_are_kept(
        random_model_dir: Path, tmp_path: Path) -> None:
    learner = make_learner(random_model_dir)
    save(learner, tmp_path, step=1)
    writer = {"host": "h", "pid": 1}
    for name, lineage in (("step-5.tmp", RUN.id), ("step-7.tmp", "other")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "writer.json").write_text(json.dumps({"lineage": lineage, **writer}))
    shutil.copytree(tmp_path / "step-1", tmp_path / "step-1.replaced")  # this run's
    (tmp_path / "step-0.tmp").mkdir()  # names no writer, older than the next save
    save(learner, tmp_path, step=2)
    assert names(tmp_path) == ["step-1", "step-2", "step-7.tmp"]


def forge(checkpoint: Path, name: str, data: bytes) -> None:
    """Put ``data`` in ``checkpoint/name`` and in its manifest, as whoever could write the
    whole folder would: only the unpickler stands in the way then."""
    (checkpoint / name).write_bytes(data)
    meta = read_meta(checkpoint)
    meta = msgspec.structs.replace(meta, files={**meta.files,
                                                name: digest_file(checkpoint / name)})
    (checkpoint / META_FILE).write_bytes(msgspec.json.encode(meta))


def test_a_metadata_that_asks_to_run_code_is_refused_without_running_it(
        random_model_dir: Path, tmp_path: Path) -> None:
    saved = save(make_learner(random_model_dir), tmp_path, step=1)
    marker = tmp_path / "ran"
    forge(saved, "dcp/.metadata", pickle.dumps(Payload(marker)))
    refused = re.escape(f"{saved / 'dcp' / '.metadata'}: refused: it asks to build "
                        "tests.learner.test_safe_dcp.write_marker")
    with pytest.raises(CheckpointError, match=refused):
        check_resumable(saved, GRPO_RUN)
    assert resumable_checkpoint(tmp_path, GRPO_RUN) is None
    with pytest.raises(CheckpointError, match=refused):
        load_checkpoint(make_learner(random_model_dir), saved)
    assert not marker.exists()


def test_a_checkpoint_another_user_could_write_is_refused_naming_the_fix(
        random_model_dir: Path, tmp_path: Path) -> None:
    previous = os.umask(0o002)  # a shared-group umask: the save still writes 0644 / 0755
    try:
        saved = save(make_learner(random_model_dir), tmp_path, step=1)
    finally:
        os.umask(previous)
    modes = [p.stat().st_mode for p in [saved, *saved.rglob("*")]]
    assert not any(mode & (stat.S_IWGRP | stat.S_IWOTH) for mode in modes)
    check_resumable(saved, GRPO_RUN)

    (saved / "hf").chmod(0o775)
    with pytest.raises(CheckpointError, match=re.escape(
            f"{saved / 'hf'}: writable by its group or by others (mode 775)")
            + f".*Fix: chmod -R go-w {re.escape(str(saved))}$"):
        check_resumable(saved, GRPO_RUN)
    assert resumable_checkpoint(tmp_path, GRPO_RUN) is None
    (saved / "hf").chmod(0o755)
    if os.geteuid() == 0:  # giving a file away needs root
        os.chown(saved / "dcp" / ".metadata", 12345, 12345)
        with pytest.raises(CheckpointError, match=re.escape(
                f"{saved / 'dcp' / '.metadata'}: owned by uid 12345, not by root")
                + f".*chown -R root {re.escape(str(saved))}$"):
            check_resumable(saved, GRPO_RUN)


def test_a_checkpoint_of_another_algorithm_or_model_is_refused(
        random_model_dir: Path, tmp_path: Path) -> None:
    folder = save(make_learner(random_model_dir), tmp_path / "grpo", step=1)
    ppo = make_learner(random_model_dir, algorithm=AlgorithmConfig(adv_estimator="gae"))
    with pytest.raises(CheckpointError, match="holds policy but this run trains policy, "
                                              "critic"):
        load_checkpoint(ppo, folder)
    wider = save_random_model(tmp_path / "wider", hidden=96)
    with pytest.raises(CheckpointError, match="do not fit this run's models"):
        load_checkpoint(make_learner(wider), folder)


@pytest.mark.parametrize("estimator, part", [("gae", "critic"), ("prime", "prm")])
def test_the_critic_and_the_prm_are_saved_and_loaded_with_their_optimizers(
        random_model_dir: Path, batches: list[TrainBatch], tmp_path: Path, estimator: str,
        part: str) -> None:
    algorithm = AlgorithmConfig(adv_estimator=estimator)
    trained = make_learner(random_model_dir, algorithm=algorithm)
    untrained = full_weights(getattr(trained, part).model)
    trained.step(batches[0])
    saved = full_weights(getattr(trained, part).model)
    assert any(not torch.equal(saved[k], untrained[k]) for k in saved)
    folder = save(trained, tmp_path, step=1)

    fresh = make_learner(random_model_dir, algorithm=algorithm)
    assert load_checkpoint(fresh, folder).parts == ["policy", part]
    module = getattr(fresh, part)
    loaded = full_weights(module.model)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    trained_moments = [s["exp_avg"] for s in getattr(trained, part).optimizer.state.values()]
    loaded_moments = [s["exp_avg"] for s in module.optimizer.state.values()]
    assert len(loaded_moments) == len(trained_moments) > 0
    assert all(torch.equal(a.full_tensor(), b.full_tensor())
               for a, b in zip(loaded_moments, trained_moments))
    assert module.scheduler.state_dict() == getattr(trained, part).scheduler.state_dict()


@pytest.mark.parametrize("estimator, part, key", [("gae", "critic", "critic.optim"),
                                                  ("prime", "prm", "reward_model.model.optim")])
def test_the_critics_and_the_prms_optimizers_take_the_configs_values_on_resume(
        random_model_dir: Path, batches: list[TrainBatch], tmp_path: Path,
        caplog: pytest.LogCaptureFixture, estimator: str, part: str, key: str) -> None:
    algorithm = AlgorithmConfig(adv_estimator=estimator)
    trained = make_learner(random_model_dir, algorithm=algorithm)  # their lr: 1e-3
    trained.step(batches[0])
    folder = save(trained, tmp_path, step=1)

    fresh = make_learner(random_model_dir, algorithm=algorithm)
    edited = OptimConfig(lr=2e-3, betas=[0.5, 0.9], weight_decay=0.0)
    if part == "critic":
        fresh.critic = Critic(fresh.critic.model, CriticConfig(optim=edited), total_steps=10)
    else:
        fresh.prm = ImplicitPRM(fresh.prm.model, fresh.prm.reference,
                                RewardModelConfig(model=PrmModelConfig(optim=edited)),
                                total_steps=10, temperature=1.0)
    with caplog.at_level(logging.INFO, logger="relay.learner.checkpoint"):
        load_checkpoint(fresh, folder)
    module = getattr(fresh, part)
    group = module.optimizer.param_groups[0]
    assert group["lr"] == 2e-3 and tuple(group["betas"]) == (0.5, 0.9)
    assert module.scheduler.get_last_lr() == [2e-3] and module.scheduler.last_epoch == 1
    assert module.optimizer.state  # the checkpoint's moments are kept
    changed = [r.getMessage().removeprefix(f"{folder}: ") for r in caplog.records
               if "in the checkpoint" in r.getMessage()]
    assert changed == [
        f"{key}.lr: 0.001 in the checkpoint, 0.002 in the config: using the config's",
        f"{key}.betas: [0.9, 0.999] in the checkpoint, [0.5, 0.9] in the config: using the "
        "config's"]


def save_from_ranks(rank: int, world: int, port: int, fsdp_size: int, model_dir: str,
                    batch_file: str, folder: str, out_file: str) -> None:
    """Train two steps (ACTOR's first one warms up from lr 0), save, and load the checkpoint
    into a fresh learner of the same layout; rank 0 keeps the weights and Adam moments of
    both."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        learner = make_learner(Path(model_dir), actor=ACTOR, fsdp_size=fsdp_size)
        for _ in range(2):
            learner.step(torch.load(batch_file, weights_only=False))
        saved = save_checkpoint(learner, Path(folder), LoopState(step=2, version=2),
                                lineage=RUN, keep_last=2, buffer=BUFFER if rank == 0 else None)
        resumed = make_learner(Path(model_dir), actor=ACTOR, fsdp_size=fsdp_size)
        load_checkpoint(resumed, saved)
        result = {name: {"weights": gather_full_weights(each.model, torch.float32),
                         "moments": [s["exp_avg"].full_tensor()
                                     for s in each.optimizer.state.values()],
                         "mesh": next(each.model.parameters()).device_mesh.shape}
                  for name, each in (("saved", learner), ("resumed", resumed))}
        if rank == 0:
            torch.save(result, out_file)
    finally:
        dist.destroy_process_group()
    exit_worker()


@pytest.mark.parametrize("world, fsdp_size", [(2, -1), (4, 2)], ids=["2 ranks", "hsdp 2x2"])
def test_a_checkpoint_of_several_ranks_loads_at_one_and_at_its_layout(
        random_model_dir: Path, tmp_path: Path, batches: list[TrainBatch], world: int,
        fsdp_size: int) -> None:
    torch.save(batches[0], tmp_path / "batch.pt")
    mp.start_processes(save_from_ranks, nprocs=world, start_method="spawn",
                       args=(world, free_port(), fsdp_size, str(random_model_dir),
                             str(tmp_path / "batch.pt"), str(tmp_path / "checkpoints"),
                             str(tmp_path / "saved.pt")))
    result = torch.load(tmp_path / "saved.pt", weights_only=False)
    saved, again = result["saved"], result["resumed"]
    layout = (world,) if fsdp_size == -1 else (world // fsdp_size, fsdp_size)
    assert saved["mesh"] == again["mesh"] == layout
    folder = latest_checkpoint(tmp_path / "checkpoints")
    assert sorted(p.name for p in (folder / "rng").iterdir()) == [
        f"rank-{r}.json" for r in range(world)]

    resumed = make_learner(random_model_dir, actor=ACTOR)
    meta = load_checkpoint(resumed, folder)
    assert meta.world_size == world and resumed.steps_done == 2
    for loaded in (full_weights(resumed.model), again["weights"]):
        assert all(torch.equal(loaded[k], v) for k, v in saved["weights"].items())
    for loaded in (moments(resumed), again["moments"]):
        assert all(torch.equal(a, b) for a, b in zip(loaded, saved["moments"], strict=True))
    initial = full_weights(make_learner(random_model_dir).model)
    assert not any(torch.equal(initial[k], v) for k, v in saved["weights"].items())  # trained


def check_shared_on_two_ranks(rank: int, port: int, folders: list[list[str]],
                              resumes: list[list[str] | None], out: str) -> None:
    """Rank r calls ``check_shared_checkpoints`` as a learner on two hosts would, on
    ``folders[case][r]`` (and ``resumes[case][r]``): two hosts are simulated by giving the
    ranks different paths for what a shared filesystem would show both at one path. Each
    case's outcome ("" or the error) goes to ``out``/rank-<r>.json."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    outcomes = []
    try:
        for folder, resume in zip(folders, resumes, strict=True):
            try:
                checkpoints.check_shared_checkpoints(
                    Path(folder[rank]), Path(resume[rank]) if resume else None, hosts=2,
                    saves=True)
                outcomes.append("")
            except CheckpointError as exc:
                outcomes.append(str(exc))
        Path(out, f"rank-{rank}.json").write_text(json.dumps(outcomes))
    finally:
        dist.destroy_process_group()
    exit_worker()


def run_shared_check(tmp_path: Path, folders: list[list[Path]],
                     resumes: list[list[Path] | None]) -> list[list[str]]:
    """Each case's outcome on rank 0 and rank 1."""
    mp.start_processes(check_shared_on_two_ranks, nprocs=2, start_method="spawn",
                       args=(free_port(), [[str(p) for p in f] for f in folders],
                             [[str(p) for p in r] if r else None for r in resumes],
                             str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    return [list(case) for case in zip(*ranks, strict=True)]


def test_a_learner_on_two_hosts_refuses_a_checkpoint_folder_one_rank_does_not_see(
        tmp_path: Path) -> None:
    shared, elsewhere = tmp_path / "shared", tmp_path / "host1-local"
    blocked = tmp_path / "a-file" / "checkpoints"  # below a file: no folder can be made
    (tmp_path / "a-file").write_text("")
    same, apart, unwritable = run_shared_check(
        tmp_path, [[shared, shared], [shared, elsewhere], [blocked, blocked]], [None] * 3)
    assert same == ["", ""]
    assert list(shared.iterdir()) == []  # the probe is removed
    # every rank refuses, naming the folder (at its own path here) and the blind rank
    assert apart[0].startswith(f"{shared}: rank 1 on ")
    assert apart[1] == apart[0].replace(str(shared), str(elsewhere), 1)
    assert "must be on a filesystem every learner host sees" in apart[0]
    assert list(shared.iterdir()) == [] and not elsewhere.exists()
    # and where rank 0 cannot write, every rank says so rather than wait for it
    assert unwritable[0] == unwritable[1]
    assert unwritable[0].startswith(f"{blocked}: rank 0 (on ")
    assert "cannot write into the checkpoint folder" in unwritable[0]


def test_a_learner_on_two_hosts_refuses_a_resume_checkpoint_one_rank_reads_otherwise(
        tmp_path: Path) -> None:
    shared = tmp_path / "checkpoints"
    checkpoint, stale = shared / "step-2", tmp_path / "host1-copy" / "step-2"
    for folder, step in ((checkpoint, 2), (stale, 1)):  # host 1 sees an older copy
        folder.mkdir(parents=True)
        (folder / "meta.json").write_text(json.dumps({"step": step}))
    same, apart = run_shared_check(tmp_path, [[shared, shared]] * 2,
                                   [[checkpoint, checkpoint], [checkpoint, stale]])
    assert same == ["", ""]
    assert apart[0].startswith(f"{checkpoint}: the checkpoint to resume from reads "
                               "differently, or not at all, on rank 1 on ")
    assert apart[1] == apart[0].replace(str(checkpoint), str(stale), 1)


def test_one_host_or_no_checkpoints_checks_nothing(tmp_path: Path) -> None:
    """The check is a collective of a multi-host learner that writes or reads checkpoints;
    otherwise it writes nothing (here: a world of one rank, which would pass it anyway)."""
    folder = tmp_path / "checkpoints"
    checkpoints.check_shared_checkpoints(folder, None, hosts=1, saves=True)
    checkpoints.check_shared_checkpoints(folder, None, hosts=2, saves=False)
    assert not folder.exists()
    checkpoints.check_shared_checkpoints(folder, None, hosts=2, saves=True)
    assert folder.is_dir() and list(folder.iterdir()) == []
