"""relay.learner.imported_optimizer: AdamW state written by name (what ``relay import-verl
--optimizer`` writes) goes into the learner's fresh FSDP2 optimizers through
``relay.learner.main`` (the policy's under ``actor.optim.state_path``, the critic's under
``critic.optim.state_path`` with verl's critic names), and the next step equals the step of
the AdamW that wrote it; names, shapes or an optimizer that has stepped that do not fit are
refused naming the key; a resumed run keeps its checkpoint's state."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from relay.configs import DEFAULT_RUN, Topology, load_run_config
from relay.configs.loader import ConfigError
from relay.configs.rundir import RunContext
from relay.learner.imported_optimizer import (
    ImportedAdamW,
    ImportedStateError,
    load_imported_state,
    write_adamw_state,
)
from relay.learner.main import build_learner, load_imported_optimizers

LR, WEIGHT_DECAY = 1e-3, 0.01  # torch's AdamW default decay, set on Relay's too


def fixed_gradients(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A gradient for every parameter, the same whichever model asks (by name)."""
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=generator)
            for name, p in sorted(model.named_parameters())}


def set_gradients(model: torch.nn.Module, gradients: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        grad = gradients[name]
        if isinstance(param, DTensor):
            grad = distribute_tensor(grad, param.device_mesh, param.placements,
                                     src_data_rank=None)
        param.grad = grad


def stepped_elsewhere(model: torch.nn.Module, folder: Path, steps: int = 2,
                      rename=lambda name: name) -> torch.optim.AdamW:
    """``model`` trained ``steps`` AdamW steps on fixed gradients (another trainer), its
    state written by name into ``folder`` as the import writes it."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for step in range(steps):
        set_gradients(model, fixed_gradients(model, step))
        optimizer.step()
    names = {id(p): rename(n) for n, p in model.named_parameters()}
    moments = {m: {names[id(p)]: s[m] for p, s in optimizer.state.items()}
               for m in ("exp_avg", "exp_avg_sq")}
    write_adamw_state(folder, moments, ImportedAdamW(step=steps, source="a test",
                                                     hyperparameters={"lr": LR}))
    return optimizer


def build(model_dir: Path, folder: Path, *overrides: str):  # noqa: ANN201 - a Learner
    run = load_run_config(DEFAULT_RUN, [f"model.path={model_dir}", f"actor.optim.lr={LR}",
                                        f"actor.optim.weight_decay={WEIGHT_DECAY}",
                                        *overrides])
    return build_learner(RunContext(run_dir=folder, topology=Topology(), run=run),
                         torch.device("cpu")), run


@pytest.mark.usefixtures("one_rank_group")
def test_the_policy_continues_the_imported_adamw_step_for_step(random_model_dir: Path,
                                                                tmp_path: Path) -> None:
    elsewhere = AutoModelForCausalLM.from_pretrained(random_model_dir)
    optimizer = stepped_elsewhere(elsewhere, tmp_path / "optimizer")
    elsewhere.save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "tokenizer.json").symlink_to(random_model_dir / "tokenizer.json")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (random_model_dir / name).exists():
            (tmp_path / "model" / name).symlink_to(random_model_dir / name)
    imported, run = build(tmp_path / "model", tmp_path / "a",
                          f"actor.optim.state_path={tmp_path / 'optimizer'}")
    load_imported_optimizers(imported, run, resumed=False)
    fresh, _ = build(tmp_path / "model", tmp_path / "b")
    gradients = fixed_gradients(elsewhere, seed=2)
    for model, opt in ((elsewhere, optimizer), (imported.model, imported.optimizer),
                       (fresh.model, fresh.optimizer)):
        set_gradients(model, gradients)
        opt.step()
    ours = {n: p.full_tensor() for n, p in imported.model.named_parameters()}
    theirs = dict(elsewhere.named_parameters())
    fresh_weights = {n: p.full_tensor() for n, p in fresh.model.named_parameters()}
    assert ours.keys() == theirs.keys()
    for name, weight in theirs.items():
        torch.testing.assert_close(ours[name], weight, rtol=0, atol=1e-6, msg=name)
    assert any(not torch.allclose(fresh_weights[n], w, atol=1e-6) for n, w in theirs.items())
    steps = {float(s["step"]) for s in imported.optimizer.state.values()}
    assert steps == {3.0}  # Adam's bias correction went on from the imported t = 2


@pytest.mark.usefixtures("one_rank_group")
def test_the_critic_takes_verls_critic_names(random_model_dir: Path, tmp_path: Path) -> None:
    critic = AutoModelForTokenClassification.from_pretrained(random_model_dir, num_labels=1)
    critic.save_pretrained(tmp_path / "critic")
    optimizer = stepped_elsewhere(critic, tmp_path / "optimizer")
    learner, run = build(random_model_dir, tmp_path / "run", "algorithm.adv_estimator=gae",
                         f"critic.model.path={tmp_path / 'critic'}",
                         f"critic.optim.state_path={tmp_path / 'optimizer'}")
    load_imported_optimizers(learner, run, resumed=False)
    ours = {n: learner.critic.optimizer.state[p]
            for n, p in learner.critic.model.named_parameters()}
    theirs = {n: optimizer.state[p] for n, p in critic.named_parameters()}
    assert len(ours) == len(theirs)
    for name, state in theirs.items():
        first, rest = name.split(".", 1)
        mine = ours[f"value_head.{rest}" if first == "score" else f"body.{rest}"]
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(mine[moment].full_tensor(), state[moment]), (name, moment)
    assert not learner.optimizer.state  # the policy's stays fresh


@pytest.mark.usefixtures("one_rank_group")
def test_a_resumed_run_keeps_its_own_state(random_model_dir: Path, tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    stepped_elsewhere(AutoModelForCausalLM.from_pretrained(random_model_dir),
                      tmp_path / "optimizer")
    learner, run = build(random_model_dir, tmp_path / "run",
                         f"actor.optim.state_path={tmp_path / 'optimizer'}")
    with caplog.at_level(logging.INFO, logger="relay.learner"):
        load_imported_optimizers(learner, run, resumed=True)
    assert not learner.optimizer.state
    assert "actor.optim.state_path not loaded: the run resumed" in caplog.text


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def test_what_does_not_fit_is_refused_naming_the_key(tmp_path: Path) -> None:
    stepped_elsewhere(tiny(), tmp_path / "ok")
    model = tiny()
    with pytest.raises(ImportedStateError, match=r"k = .*: no state.json there"):
        load_imported_state(model, torch.optim.AdamW(model.parameters()), tmp_path, "k")
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 5))
    with pytest.raises(ImportedStateError, match=r"exp_avg of 1.weight is \(2, 4\), the "
                                                 r"parameter \(5, 4\)"):
        load_imported_state(other, torch.optim.AdamW(other.parameters()), tmp_path / "ok", "k")
    with pytest.raises(ImportedStateError, match=r"no state for 4 of its parameters \(0."
                                                 r"weight.*state for 4 parameters it does "
                                                 r"not train \(x.0.bias"):
        load_imported_state(model, torch.optim.AdamW(model.parameters()), tmp_path / "ok",
                            "k", rename=lambda name: f"x.{name}")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    with pytest.raises(ImportedStateError, match="k: the optimizer has state already"):
        load_imported_state(model, optimizer, tmp_path / "ok", "k")


@pytest.mark.parametrize("overrides, key, why", [
    (["model.lora_rank=8", "actor.optim.state_path=STATE"], "actor.optim.state_path",
     "model.lora_rank > 0"),
    (["algorithm.adv_estimator=gae", "critic.model.lora_rank=8",
      "critic.optim.state_path=STATE"], "critic.optim.state_path",
     "critic.model.lora_rank > 0"),
])
def test_the_config_refuses_states_it_cannot_take(tmp_path: Path, random_model_dir: Path,
                                                  overrides: list[str], key: str,
                                                  why: str) -> None:
    stepped_elsewhere(tiny(), tmp_path / "ok")
    overrides = [o.replace("STATE", str(tmp_path / "ok")) for o in overrides]
    with pytest.raises(ConfigError, match=rf"{key}.*not available with {why}"):
        load_run_config(DEFAULT_RUN, [f"model.path={random_model_dir}", *overrides])
    with pytest.raises(ConfigError, match=rf"actor.optim.state_path.*{tmp_path}: no "
                                          r"state.json there"):
        load_run_config(DEFAULT_RUN, [f"model.path={random_model_dir}",
                                      f"actor.optim.state_path={tmp_path}"])
