"""relay.learner.main.build_learner shards each model it loads by its own verl ``fsdp_size`` key
(the policy by the actor's, the reference by the ref's, the critic by the critic's), and
refuses one that does not divide the learner's ranks naming that key, before loading; a
learner started without torchrun is a group of one that opens no rendezvous port."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relay.configs import DEFAULT_RUN, Topology, load_run_config
from relay.configs.rundir import RunContext
from relay.learner.main import build_learner

pytestmark = pytest.mark.usefixtures("one_rank_group")


def build(model_dir: Path, folder: Path, *overrides: str):  # noqa: ANN201 - a Learner
    run = load_run_config(DEFAULT_RUN, [f"model.path={model_dir}", *overrides])
    return build_learner(RunContext(run_dir=folder, topology=Topology(), run=run),
                         torch.device("cpu"))


@pytest.mark.parametrize("overrides, key", [
    (["actor.fsdp_config.fsdp_size=2"], "actor.fsdp_config.fsdp_size"),
    (["actor.use_kl_loss=true", "ref.fsdp_config.fsdp_size=2"], "ref.fsdp_config.fsdp_size"),
    (["algorithm.adv_estimator=gae", "critic.model.fsdp_config.fsdp_size=2"],
     "critic.model.fsdp_config.fsdp_size"),
])
def test_an_fsdp_size_that_does_not_divide_the_ranks_is_refused_naming_its_key(
        random_model_dir: Path, tmp_path: Path, overrides: list[str], key: str) -> None:
    with pytest.raises(ValueError, match=rf"^{key} = 2: must be -1 .* divide the learner's 1"):
        build(random_model_dir, tmp_path, *overrides)


def test_only_the_models_a_run_loads_are_sharded_by_their_key(random_model_dir: Path,
                                                                tmp_path: Path) -> None:
    """No reference without a KL term, no critic without gae: their sizes are not read."""
    learner = build(random_model_dir, tmp_path, "ref.fsdp_config.fsdp_size=2",
                    "critic.model.fsdp_config.fsdp_size=2")
    assert learner.reference is None and learner.critic is None
    learner = build(random_model_dir, tmp_path, "actor.use_kl_loss=true",
                    "algorithm.adv_estimator=gae")
    meshes = {p.device_mesh for m in (learner.model, learner.reference, learner.critic.model)
              for p in m.parameters()}
    assert len(meshes) == 1 and next(iter(meshes)).shape == (1,)  # one mesh shared by all


ALONE = """
import os, subprocess
from datetime import timedelta
import torch
import torch.distributed as dist
from relay.learner.main import init_learner_group
init_learner_group(torch.device("cpu"), timedelta(seconds=60))
ones = torch.ones(2)
dist.all_reduce(ones)
listening = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
print(dist.get_world_size(), ones.tolist(),
      sorted(line.split()[3].rsplit(":", 1)[0] for line in listening.splitlines()
             if f"pid={os.getpid()}," in line))
"""


@pytest.mark.parametrize("inherited", ["nothing", "a_parents_group"])
def test_a_learner_started_alone_is_one_rank_on_no_rendezvous_port(inherited: str) -> None:
    """``relay.launcher.plan`` starts one rank on one host without torchrun (whose store listens
    on every interface): no store port, whatever it inherited (``tools/gpu-check.py`` runs
    a process group of its own, whose WORLD_SIZE=1 and MASTER_PORT, a port it holds, reach
    the launcher's children); gloo's own socket is on loopback."""
    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2) to list listening sockets")
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["GLOO_SOCKET_IFNAME"] = "lo"  # as relay.launcher.plan sets it
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        if inherited == "a_parents_group":
            env.update(WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(held.getsockname()[1]))
        done = subprocess.run([sys.executable, "-c", ALONE], capture_output=True, text=True,
                              env=env, timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("[", 1)[0].strip() == "1"
    assert "[1.0, 1.0]" in done.stdout
    assert done.stdout.rstrip().endswith("['127.0.0.1']"), done.stdout  # gloo's only
