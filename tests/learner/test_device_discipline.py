"""The learner's step keeps to its device, proven on the CPU (issue 29).

Three checks:

- real CPU steps of every kind the learner takes (grpo in rows, gae with the critic, prime,
  shared prompts, dynamic batch size, KL loss with the reference, parameter offload, and at
  two gloo ranks Ulysses and data parallelism) run under ``tests.device_audit.DeviceAudit``:
  no tensor factory in ``learner/`` or ``algorithms/`` is called without a device (on a
  GPU it would put its tensor on the CPU beside CUDA data), and the host syncs stay within
  a small number a micro-batch pass, a mini-batch and a step (``SYNCS_PER_PASS``...);
- the batch's way through a step on fake CUDA tensors (``tests.fake_cuda``): moved once to
  the learner's device, then cut (``MicroBatches.passes``, ``TrainBatch.select``) and packed
  (``shared_prompts.pack``, ``ulysses.pack_tokens``) on it, with the CPU's values;
- the diagnostics sums live on the learner's device and are read once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from relay.configs.run_schema import ActorConfig, AlgorithmConfig, FsdpConfig, OptimConfig
from relay.generators.torch_engine import TorchEngine
from relay.learner.batch import TrainBatch, collate
from relay.learner.micro_batches import MicroBatches, mini_batch_totals
from relay.learner.shared_prompts import pack
from relay.learner.ulysses import learner_parallelism, pack_tokens
from relay.learner.update import Learner, _Sums, peak_memory_gb, reset_peak_memory

from ..conftest import exit_worker, free_port
from ..device_audit import DeviceAudit
from ..fake_cuda import CUDA, CudaTensor, fake_cuda, on_cuda
from .test_update import LR, build_learner, rollouts
from .test_update_algorithms import make_learner

# Host syncs (explicit reads: tolist, item, float, int, bool) a step may make, as a bound
# of the form  syncs <= SYNCS_PER_PASS x passes + SYNCS_PER_WALK x walks + SYNCS_PER_STEP,
# where a walk is one ``MicroBatches.passes`` over a mini-batch (the actor's, the up-front
# log-prob passes', the critic's, the PRM's):
# - a pass: the packing's one read of its rows' lengths (shared prompts, Ulysses) or the
#   PRM's check that its labels lie in [0, 1]; a row pass makes none;
# - a walk: the cut's one read of the mini-batch's lengths (and group ids), at several
#   ranks their comparison of pass counts, and the optimizer step's read of the gradient
#   norm (whether to step) or PRIME's leave-one-out check of its groups;
# - a step: the mini-batches' loss denominators, the diagnostics' one read, the advantages'
#   group count, the TD-errors, the critic's and the PRM's metrics, KL's and PRIME's means.
SYNCS_PER_PASS, SYNCS_PER_WALK, SYNCS_PER_STEP = 1, 3, 8
FOLDERS = ["learner", "algorithms"]


def optim() -> OptimConfig:
    return OptimConfig(lr=LR, weight_decay=0.0)


def actor(**overrides: object) -> ActorConfig:
    """Two mini-batches (2 groups, then 1) of passes of at most 4 rows."""
    options = dict(optim=optim(), ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4,
                   share_prompts=False)
    return ActorConfig(**{**options, **overrides})


CONFIGS: dict[str, dict[str, object]] = {
    "grpo in rows": dict(actor=actor()),
    "gae with the critic": dict(actor=actor(), algorithm=AlgorithmConfig(adv_estimator="gae")),
    "prime": dict(actor=actor(), algorithm=AlgorithmConfig(adv_estimator="prime")),
    "shared prompts": dict(actor=actor(share_prompts=True)),
    "dynamic batch size": dict(actor=actor(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=60)),
    "kl loss with the reference": dict(actor=actor(use_kl_loss=True, entropy_coeff=0.01)),
}


@pytest.fixture(scope="module")
def batch(random_model_dir: Path) -> TrainBatch:
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32,
                                         eos_ids=[2], pad_id=0, seed=11)
    return collate(rollouts(engine, 1), pad_id=0)


class AuditedStep(msgspec.Struct):
    """What one audited step did: its unplaced factories, host syncs (site -> count),
    micro-batch passes and walks over a mini-batch."""

    unplaced: list[str]
    syncs: dict[str, int]
    passes: int
    walks: int
    report: str

    def summary(self) -> str:
        return (f"{self.passes} passes in {self.walks} walks, {sum(self.syncs.values())} "
                f"syncs, {len(self.unplaced)} unplaced factories\n{self.report}")


def audited_step(learner: Learner, batch: TrainBatch, monkeypatch: pytest.MonkeyPatch
                 ) -> AuditedStep:
    """``learner.step(batch)`` under ``DeviceAudit``, counting the passes it walks (the
    actor's, the up-front passes', the critic's and the PRM's)."""
    passes, walks = [0], [0]
    walk = MicroBatches.passes

    def counted(self: MicroBatches, *args: object) -> Iterator[object]:
        walks[0] += 1
        for each in walk(self, *args):
            passes[0] += 1
            yield each

    monkeypatch.setattr(MicroBatches, "passes", counted)
    with DeviceAudit(FOLDERS) as audit:
        learner.step(batch)
    monkeypatch.setattr(MicroBatches, "passes", walk)
    return AuditedStep(unplaced=sorted(set(audit.unplaced)), syncs=dict(audit.syncs),
                       passes=passes[0], walks=walks[0], report=audit.report())


def assert_disciplined(step: AuditedStep) -> None:
    assert step.unplaced == [], step.report
    bound = (SYNCS_PER_PASS * step.passes + SYNCS_PER_WALK * step.walks + SYNCS_PER_STEP)
    assert sum(step.syncs.values()) <= bound, step.summary()


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_a_step_names_every_device_and_syncs_a_bounded_number_of_times(
        random_model_dir: Path, batch: TrainBatch, config: dict[str, object],
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    step = audited_step(make_learner(random_model_dir, **config), batch, monkeypatch)
    print(step.summary())
    assert step.passes >= 3
    assert_disciplined(step)


@pytest.mark.usefixtures("one_rank_group")
def test_a_step_with_offloaded_parameters_and_optimizer_names_every_device(
        random_model_dir: Path, batch: TrainBatch, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    learner = build_learner(random_model_dir, ppo_mini_batch_size=2,
                            ppo_micro_batch_size_per_gpu=4, share_prompts=False,
                            fsdp_config=FsdpConfig(param_offload=True, optimizer_offload=True))
    step = audited_step(learner, batch, monkeypatch)
    print(step.summary())
    assert_disciplined(step)


def gathered_parameters(learner: Learner) -> list[str]:
    """The parameters of the learner's models that are not FSDP2 shards (``DTensor``): ones
    left gathered after a forward (on a GPU, full copies on the device, beside the CPU
    shards of ``param_offload``)."""
    models = {"actor": learner.model, "reference": learner.reference}
    if learner.prm is not None:
        models.update({"prm": learner.prm.model, "prm reference": learner.prm.reference})
    return [f"{name} {param_name}" for name, model in models.items() if model is not None
            for param_name, param in model.named_parameters()
            if not isinstance(param, DTensor)]


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("config", [CONFIGS["kl loss with the reference"], CONFIGS["prime"]],
                         ids=["kl loss with the reference", "prime"])
def test_a_step_leaves_no_model_gathered(random_model_dir: Path, batch: TrainBatch,
                                         config: dict[str, object]) -> None:
    """FSDP2 keeps its root module's parameters gathered after a forward, for the backward
    that follows; after no-grad passes (the reference's, the PRM's scoring) none comes, so
    the embedding and final norm stayed gathered on the GPU beside the CPU shards of
    ``param_offload`` (gpu-check A/offload on an H100). After a step every model the learner
    holds is back to its shards."""
    learner = make_learner(random_model_dir, **config)
    learner.step(batch)
    assert gathered_parameters(learner) == []


TWO_RANKS = {"ulysses": dict(sp=2, actor=dict(ulysses_sequence_parallel_size=2)),
             "data parallel: critic, dynamic batch size, shared prompts": dict(
                 sp=1, algorithm="gae", actor=dict(use_dynamic_bsz=True,
                                                   ppo_max_token_len_per_gpu=60,
                                                   share_prompts=True))}


def two_rank_worker(rank: int, port: int, model_dir: str, batch_file: str, name: str,
                    out_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        spec = TWO_RANKS[name]
        torch.manual_seed(0)
        batch = torch.load(batch_file, weights_only=False)
        learner = make_learner(
            Path(model_dir), actor=actor(**spec["actor"]),
            algorithm=AlgorithmConfig(adv_estimator=spec.get("algorithm", "grpo")),
            parallelism=learner_parallelism(torch.device("cpu"), spec["sp"]))
        with pytest.MonkeyPatch.context() as monkeypatch:
            step = audited_step(learner, batch, monkeypatch)
        Path(f"{out_file}.{rank}").write_bytes(msgspec.json.encode(step))
    finally:
        dist.destroy_process_group()
    exit_worker()


@pytest.mark.parametrize("name", TWO_RANKS)
def test_two_ranks_name_every_device_and_sync_a_bounded_number_of_times(
        random_model_dir: Path, batch: TrainBatch, tmp_path: Path, name: str) -> None:
    """The collectives' tensors (the pass counts of ``MicroBatches``, the sums) are built on
    the device too: a CPU tensor handed to NCCL fails."""
    batch_file, out = tmp_path / "batch.pt", tmp_path / "step"
    torch.save(batch, batch_file)
    mp.start_processes(two_rank_worker, args=(free_port(), str(random_model_dir),
                                              str(batch_file), name, str(out)),
                       nprocs=2, start_method="spawn")
    for rank in range(2):
        step = msgspec.json.decode(Path(f"{out}.{rank}").read_bytes(), type=AuditedStep)
        print(f"rank {rank}: {step.summary()}")
        assert_disciplined(step)


# -- the batch's way through a step, on fake CUDA tensors ---------------------------------

def cuda_batch(batch: TrainBatch) -> TrainBatch:
    with fake_cuda():
        moved = batch.to(CUDA, non_blocking=True)
    assert all(isinstance(getattr(moved, f), CudaTensor) for f in moved.__struct_fields__)
    return moved


def assert_same(on_gpu: object, on_cpu: object) -> None:
    """Every tensor of ``on_gpu`` (a tensor or a struct of them, nested) is on CUDA with the
    values of its counterpart in ``on_cpu``."""
    if isinstance(on_cpu, torch.Tensor):
        assert isinstance(on_gpu, CudaTensor), type(on_gpu)
        torch.testing.assert_close(on_gpu.host, on_cpu, equal_nan=True)
    elif isinstance(on_cpu, msgspec.Struct):
        for field in on_cpu.__struct_fields__:
            assert_same(getattr(on_gpu, field), getattr(on_cpu, field))
    elif isinstance(on_cpu, (tuple, list)):
        for mine, theirs in zip(on_gpu, on_cpu, strict=True):
            assert_same(mine, theirs)
    else:
        assert on_gpu == on_cpu


def test_a_cpu_batch_is_not_copied_to_the_cpu(batch: TrainBatch) -> None:
    assert batch.to(torch.device("cpu"), non_blocking=True) is batch


def test_collate_pins_only_where_torch_has_a_gpu(random_model_dir: Path) -> None:
    engine = TorchEngine.from_pretrained(str(random_model_dir), dtype=torch.float32,
                                         eos_ids=[2], pad_id=0, seed=11)
    groups = rollouts(engine, 1)
    pinned = collate(groups, pad_id=0, pin_memory=True)
    assert_same_cpu = collate(groups, pad_id=0)
    for field in pinned.__struct_fields__:
        tensor = getattr(pinned, field)
        assert tensor.is_pinned() == torch.cuda.is_available()
        torch.testing.assert_close(tensor, getattr(assert_same_cpu, field), equal_nan=True)


@pytest.mark.usefixtures("one_rank_group")
def test_the_step_moves_its_batch_to_the_learners_device_once(
        random_model_dir: Path, batch: TrainBatch, monkeypatch: pytest.MonkeyPatch) -> None:
    learner = make_learner(random_model_dir, actor=actor())
    assert learner.device == torch.device("cpu")  # the model's
    moves: list[tuple[torch.device, bool]] = []
    move = TrainBatch.to

    def recorded(self: TrainBatch, device: torch.device, non_blocking: bool = False):
        moves.append((device, non_blocking))
        return move(self, device, non_blocking)

    monkeypatch.setattr(TrainBatch, "to", recorded)
    learner.step(batch)
    assert moves == [(learner.device, True)]


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("cut", [dict(micro_batch_size=4),
                                 dict(micro_batch_size=1, max_token_len=60)])
def test_passes_are_cut_on_the_device_of_the_batch(batch: TrainBatch, share_prompts: bool,
                                                   cut: dict[str, int]) -> None:
    """Rows, parts and the mini-batches' totals on CUDA, as on the CPU (``select`` trims
    each pass to the width the cut read on the host)."""
    micro = MicroBatches(groups_per_mini_batch=2, share_prompts=share_prompts, **cut)
    minis = micro.mini_batches(batch)
    expected = [list(micro.passes(batch, mini)) for mini in minis]
    on_gpu = cuda_batch(batch)
    with fake_cuda():
        gpu_minis = micro.mini_batches(on_gpu)
        got = [list(micro.passes(on_gpu, mini)) for mini in gpu_minis]
        totals = mini_batch_totals(on_gpu, gpu_minis)
    assert_same(gpu_minis, minis)
    assert_same(got, expected)
    assert totals == mini_batch_totals(batch, minis)
    assert sum(len(p) for p in got) > len(got)  # several passes a mini-batch


def test_packing_a_pass_with_shared_prompts_stays_on_the_device_of_the_batch(
        batch: TrainBatch) -> None:
    """Every index, mask and position of ``shared_prompts.pack`` on CUDA, as on the CPU;
    and the labels it gathers."""
    part = batch.select(torch.arange(8))
    on_gpu = cuda_batch(part)
    with fake_cuda():
        packed = pack(on_gpu)
        labels = packed.labels(on_gpu)
    expected = pack(part)
    assert_same(packed, expected)
    assert_same(labels, expected.labels(part))


def test_packing_a_multi_turn_pass_stays_on_the_device_and_reads_the_host_once(
        batch: TrainBatch) -> None:
    """A pass whose responses have inserted tokens (response mask 0 inside the response, as
    a multi-turn episode's ``loss_mask`` makes it): the predictions left out of ``pack`` are
    picked on CUDA, with the pass's one host read."""
    part = batch.select(torch.arange(8))
    inside = part.response_mask.cumsum(-1) == 2  # each row's second response token
    part = msgspec.structs.replace(part, response_mask=part.response_mask.masked_fill(inside, 0))
    on_gpu = cuda_batch(part)
    with fake_cuda(), DeviceAudit(FOLDERS) as audit:
        packed = pack(on_gpu)
    expected = pack(part)
    assert_same(packed, expected)
    assert len(expected.predictors) == int(part.response_mask.sum())
    assert audit.sync_count == 1 and audit.unplaced == [], audit.report()


def test_packing_a_pass_for_ulysses_stays_on_the_device_of_the_batch(batch: TrainBatch) -> None:
    part = batch.select(torch.arange(5))
    on_gpu = cuda_batch(part)
    with fake_cuda():
        packed = pack_tokens(on_gpu, multiple=4)
        grid = packed.to_grid(packed.position_ids.float())
    expected = pack_tokens(part, multiple=4)
    assert_same(packed, expected)
    assert_same(grid, expected.to_grid(expected.position_ids.float()))


def test_step_sums_live_on_the_learners_device_and_are_read_once() -> None:
    """Tensors accumulate on CUDA (never read per pass), numbers on the host; one read."""
    with fake_cuda():
        sums = _Sums(CUDA)
        for value in (1.5, 2.0):
            sums.add("tokens", on_cuda(torch.tensor([value, value])).sum())
            sums.add("rows_skipped", value)
            sums.max("actor/importance_weight_max", on_cuda(torch.tensor(value)))
        assert isinstance(sums.values["tokens"], CudaTensor)
        assert isinstance(sums.values["rows_skipped"], float)
        with DeviceAudit(FOLDERS) as audit:
            reduced = sums.reduced(None)
    assert reduced == {"tokens": 7.0, "rows_skipped": 3.5, "actor/importance_weight_max": 2.0}
    assert audit.sync_count == 1 and audit.unplaced == []



def test_peak_memory_is_logged_on_a_gpu_and_left_out_on_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``perf/max_memory_allocated_gb``: torch's peak on the GPU since the step began, in
    GiB; nothing on the CPU, whose peak resident memory cannot be reset per step."""
    resets: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3 * 2**29)
    reset_peak_memory(CUDA)
    assert resets == [CUDA]
    assert peak_memory_gb(CUDA) == {"perf/max_memory_allocated_gb": 1.5}
    reset_peak_memory(torch.device("cpu"))
    assert resets == [CUDA] and peak_memory_gb(torch.device("cpu")) == {}
