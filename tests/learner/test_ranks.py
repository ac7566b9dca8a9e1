"""Two learner ranks make the same update as one (FSDP2 over gloo, real processes).

The batch is split across ranks row by row, and losses are normalised by whole-batch
counts, so the number of ranks must not change the step. Checked with the plain GRPO
update and with the paths that need cross-rank sums: KL in the reward feeding a
batch-whitened estimator (REINFORCE++), PPO's critic (values gathered from both ranks),
PRIME (process rewards from both ranks' rows, whitened over the batch), and M2PO, whose
mask depends on the second moment over the whole batch (proximal log-probs gathered from
both ranks; its tau is set so that the second step masks about a third of the
tokens). Four ranks hybrid-sharded as 2 x 2 (HSDP: ``actor.fsdp_config.fsdp_size = 2``,
two replicas of two shards each, for the policy, its reference and the critic) make the
same update too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relay.algorithms.off_policy import RolloutCorrectionConfig
from relay.configs.run_schema import AlgorithmConfig
from relay.generators.torch_engine import TorchEngine
from relay.learner.batch import TrainBatch, collate
from relay.learner.update import Learner

from ..conftest import exit_worker, free_port, gather_full_weights
from .test_update import LR, rollouts
from .test_update_algorithms import make_learner

ALGORITHMS = {
    "grpo": AlgorithmConfig(),
    "reinforce++ with kl in reward": AlgorithmConfig(adv_estimator="reinforce_plus_plus",
                                                     use_kl_in_reward=True),
    "ppo with critic": AlgorithmConfig(adv_estimator="gae", lam=0.95),
    "prime": AlgorithmConfig(adv_estimator="prime"),
    "m2po": AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(m2po=True,
                                                                       m2po_tau=0.01)),
}


def train_two_steps(rank: int, world: int, port: int, model_dir: str, batch_file: str,
                    algorithm: AlgorithmConfig, out_file: str, fsdp_size: int = -1) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        batch = torch.load(batch_file, weights_only=False)
        learner = make_learner(Path(model_dir), algorithm=algorithm, fsdp_size=fsdp_size)
        mesh = (world,) if fsdp_size == -1 else (world // fsdp_size, fsdp_size)
        models = [learner.model, learner.reference, learner.critic and learner.critic.model]
        assert {p.device_mesh.shape for m in models if m for p in m.parameters()} == {mesh}
        save_two_steps(learner, batch, rank, out_file)
    finally:
        dist.destroy_process_group()
    exit_worker()


def save_two_steps(learner: Learner, batch: TrainBatch, rank: int, out_file: str) -> None:
    """Two steps of ``learner`` on ``batch``; rank 0 saves their losses, rejected fractions
    and the full weights after them (``assert_same_update`` compares two such results)."""
    metrics = [learner.step(batch, version=v).metrics for v in range(2)]
    with learner.full_policy():
        weights = gather_full_weights(learner.model, torch.float32)
    if rank == 0:
        torch.save({"losses": [m["actor/loss"] for m in metrics],
                    "rejected": [m["actor/rejected_frac"] for m in metrics],
                    "weights": weights}, out_file)


def run_world(world: int, *args: object) -> None:
    mp.start_processes(train_two_steps, args=(world, free_port(), *args), nprocs=world,
                       start_method="spawn")


def train_at(worlds: list[tuple[int, int]], model_dir: Path, folder: Path,
             algorithm: AlgorithmConfig) -> list[dict]:
    """The results of ``train_two_steps`` on one batch, at each (world size, fsdp_size)."""
    engine = TorchEngine.from_pretrained(str(model_dir), dtype=torch.float32,
                                         eos_ids=[2], pad_id=0, seed=5)
    batch_file = folder / "batch.pt"
    torch.save(collate(rollouts(engine, 1), pad_id=0), batch_file)
    results = []
    for world, fsdp_size in worlds:
        out = folder / f"world{world}.pt"
        run_world(world, str(model_dir), str(batch_file), algorithm, str(out), fsdp_size)
        results.append(torch.load(out, weights_only=False))
    return results


@pytest.mark.parametrize("algorithm", ALGORITHMS.values(), ids=ALGORITHMS.keys())
def test_two_ranks_match_one(random_model_dir: Path, tmp_path: Path,
                             algorithm: AlgorithmConfig) -> None:
    one, two = train_at([(1, -1), (2, -1)], random_model_dir, tmp_path, algorithm)
    assert_same_update(one, two)
    if algorithm.rollout_correction.m2po:
        assert 0 < one["rejected"][1] < 1


@pytest.mark.slow  # 4 processes loading 3 models each: 110 s on a busy 2-core machine
def test_hybrid_sharding_2x2_matches_one_rank(random_model_dir: Path, tmp_path: Path) -> None:
    """Fails when the replicas do not all-reduce their gradients (each replica's FSDP2
    over its shard group alone: mesh["shard"])."""
    algorithm = AlgorithmConfig(adv_estimator="gae", lam=0.95, use_kl_in_reward=True)
    one, four = train_at([(1, -1), (4, 2)], random_model_dir, tmp_path, algorithm)
    assert_same_update(one, four)


def assert_same_update(one: dict, two: dict) -> None:
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5)
    assert two["rejected"] == pytest.approx(one["rejected"], abs=1e-6)
    # Adam moves a weight by about lr whatever its gradient's size, so where a gradient is
    # ~0 the float noise of summing in another order (other ranks, other passes) can flip
    # its sign: such weights may differ by up to ~lr. A wrong update moves most weights.
    for name, tensor in one["weights"].items():
        close = torch.isclose(two["weights"][name], tensor, atol=LR / 100, rtol=1e-4)
        assert float(close.float().mean()) > 0.999, name
        torch.testing.assert_close(two["weights"][name], tensor, atol=LR / 5, rtol=1e-4)
