"""The learning-rate schedules (transformers' own), against hand-computed rates, and resumed
with the config's rate over a checkpoint's; gradient clipping over FSDP2 shards, offloaded
or not, at one and two ranks."""

import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.optim.lr_scheduler import LambdaLR

from relay.configs.run_schema import OptimConfig
from relay.learner.optim import (
    build_optimizer,
    build_scheduler,
    clipped_step,
    configured_values,
    reapply_configured,
)

from ..conftest import exit_worker, free_port
from ..fake_cuda import CUDA, fake_cuda


def rates(optim: OptimConfig, total_steps: int, steps: int) -> list[float]:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    scheduler = build_scheduler(optimizer, total_steps=total_steps, optim=optim)
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return out


def test_constant_after_a_linear_warm_up_from_zero_as_verl() -> None:
    assert rates(OptimConfig(lr=1.0, lr_warmup_steps=4), 10, 6) == \
        pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 1.0])


def test_warm_up_ratio_counts_steps_of_the_run() -> None:
    # -1 steps: 0.2 of 10 = 2 warm-up steps
    assert rates(OptimConfig(lr=1.0, lr_warmup_steps_ratio=0.2), 10, 3) == \
        pytest.approx([0.0, 0.5, 1.0])


def test_cosine_decays_to_the_min_lr_ratio_at_the_last_step() -> None:
    optim = OptimConfig(lr=2.0, lr_warmup_steps=2, warmup_style="cosine", min_lr_ratio=0.1)
    got = rates(optim, 10, 11)
    # s >= 2: 2 * (0.1 + 0.9 * (1 + cos(pi * (s - 2) / 8)) / 2)
    expected = [0.0, 1.0] + [2 * (0.1 + 0.9 * (1 + math.cos(math.pi * (s - 2) / 8)) / 2)
                             for s in range(2, 11)]
    assert got == pytest.approx(expected)
    assert got[-1] == pytest.approx(0.2)


# -- resuming: the config's values over a checkpoint's, the schedule's step kept ----------

def stepped(optim: OptimConfig, steps: int) -> tuple[torch.optim.AdamW, LambdaLR]:
    optimizer = build_optimizer(torch.nn.Linear(2, 1), optim)
    scheduler = build_scheduler(optimizer, total_steps=10, optim=optim)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return optimizer, scheduler


def resumed(saved: OptimConfig, config: OptimConfig, steps: int) -> tuple[
        torch.optim.AdamW, LambdaLR, list[str]]:
    """An optimizer and schedule built from ``config``, loaded with the state of ones built
    from ``saved`` and stepped ``steps`` times, as ``relay.learner.checkpoint`` loads them."""
    old_optimizer, old_scheduler = stepped(saved, steps)
    optimizer, scheduler = stepped(config, 0)
    configured = configured_values(optimizer, scheduler)
    optimizer.load_state_dict(old_optimizer.state_dict())
    scheduler.load_state_dict(old_scheduler.state_dict())
    return optimizer, scheduler, reapply_configured(optimizer, scheduler, configured,
                                                    "actor.optim")


def test_a_resumed_schedule_follows_the_configs_rate_from_the_checkpoints_step() -> None:
    saved = OptimConfig(lr=1.0, lr_warmup_steps=4, weight_decay=0.0)
    config = OptimConfig(lr=0.5, lr_warmup_steps=4, weight_decay=0.05, betas=[0.8, 0.9])
    optimizer, scheduler, changes = resumed(saved, config, steps=2)
    rates = []
    for _ in range(4):  # warm-up s / 4 of 0.5 from s = 2, then constant
        rates.append((scheduler.get_last_lr()[0], optimizer.param_groups[0]["lr"]))
        optimizer.step()
        scheduler.step()
    assert rates == [(0.25, 0.25), (0.375, 0.375), (0.5, 0.5), (0.5, 0.5)]
    group = optimizer.param_groups[0]
    assert (group["initial_lr"], group["weight_decay"], tuple(group["betas"])) == (
        0.5, 0.05, (0.8, 0.9))
    assert changes == [
        "actor.optim.lr: 1.0 in the checkpoint, 0.5 in the config: using the config's",
        "actor.optim.betas: [0.9, 0.999] in the checkpoint, [0.8, 0.9] in the config: using "
        "the config's",
        "actor.optim.weight_decay: 0.0 in the checkpoint, 0.05 in the config: using the "
        "config's"]


def test_an_unchanged_config_resumes_the_checkpoints_rate_and_reports_nothing() -> None:
    optim = OptimConfig(lr=2.0, lr_warmup_steps=2, warmup_style="cosine", min_lr_ratio=0.1)
    optimizer, scheduler, changes = resumed(optim, optim, steps=5)
    reference_optimizer, reference = stepped(optim, 5)
    assert changes == []
    assert scheduler.get_last_lr() == reference.get_last_lr() != [2.0]
    assert optimizer.param_groups[0]["lr"] == reference_optimizer.param_groups[0]["lr"]


# -- clipping: the norm over every rank's shards, combined on the compute device ----------

def tiny_net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def clipped_by_hand(offload: bool) -> dict[str, object]:
    """One ``clipped_step`` (SGD, lr 1) of an FSDP2 net (parameters offloaded to the CPU or
    not) on the same data on every rank, and the unsharded net's numbers: its gradient's
    norm and the weights after p - g min(1, max_norm / ||g||), max_norm half the norm."""
    model, reference = tiny_net(), tiny_net()
    options = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    for layer in (model[0], model[2], model):
        fully_shard(layer, **options)
    data = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for net in (model, reference):
        (net(data) ** 2).sum().backward()
    grads = [p.grad for p in reference.parameters()]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                       for g in grads])))
    max_norm = norm / 2
    got = clipped_step(model, torch.optim.SGD(model.parameters(), lr=1.0), max_norm,
                       device=torch.device("cpu"))
    scale = min(1.0, max_norm / (norm + 1e-6))
    expected = [p.detach() - g * scale for p, g in zip(reference.parameters(), grads)]
    weights = [p.full_tensor() for p in model.parameters()]
    return {"norm": got, "expected_norm": norm, "weights": weights, "expected": expected}


def assert_clipped_by_hand(result: dict[str, object]) -> None:
    assert result["norm"] == pytest.approx(result["expected_norm"], rel=1e-6)
    for got, expected in zip(result["weights"], result["expected"], strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("offload", [False, True])
def test_clipping_at_one_rank_scales_the_gradient_to_max_norm(offload: bool) -> None:
    assert_clipped_by_hand(clipped_by_hand(offload))


def clip_worker(rank: int, port: int, out_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results = {offload: clipped_by_hand(offload) for offload in (False, True)}
        if rank == 0:
            torch.save(results, out_file)
    finally:
        dist.destroy_process_group()
    exit_worker()


def test_clipping_at_two_ranks_takes_the_norm_over_both_ranks_shards(tmp_path: Path) -> None:
    """Each rank holds half of every parameter: the norm is that of the whole gradient."""
    out = tmp_path / "clipped.pt"
    mp.start_processes(clip_worker, args=(free_port(), str(out)), nprocs=2,
                       start_method="spawn")
    for result in torch.load(out, weights_only=False).values():
        assert_clipped_by_hand(result)


def test_the_norm_is_taken_to_the_compute_device_before_it_is_used() -> None:
    """Under ``param_offload`` the gradients are on the CPU, the learner computes on a GPU:
    the norm the ranks combine (in the clipping's arithmetic and ``full_tensor``, under
    FSDP2) must be there, where NCCL reduces it (verl's ``fsdp2_clip_grad_norm_``)."""
    model = tiny_net()
    (model(torch.ones(2, 4)) ** 2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    used: list[torch.Tensor] = []
    clip = torch.nn.utils.clip_grads_with_norm_

    def recorded(params, max_norm, total_norm, foreach=None):
        used.append(total_norm)
        return clip(params, max_norm, total_norm, foreach)

    with pytest.MonkeyPatch.context() as monkeypatch, fake_cuda():
        monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", recorded)
        got = clipped_step(model, torch.optim.SGD(model.parameters(), lr=0.0), 1.0,
                           device=CUDA)
    assert got == pytest.approx(norm, rel=1e-6)
    assert len(used) == 1 and used[0].device.type == "cuda"
    assert all(param.grad is None for param in model.parameters())  # stepped, cleared
