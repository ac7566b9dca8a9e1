"""learner.main.build_learner shards each model it loads by its own verl ``fsdp_size`` key
(the policy by the actor's, the reference by the ref's, the critic by the critic's), and
refuses one that does not divide the learner's ranks naming that key, before loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from configs import DEFAULT_RUN, Topology, load_run_config
from configs.rundir import RunContext
from learner.main import build_learner

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
