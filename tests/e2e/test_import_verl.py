"""A verl run continued in Relay, as a user does it: ``relay import-verl --optimizer`` on a
checkpoint saved by two real FSDP2 ranks the way verl saves it (actor and critic), then a
PPO run through the launcher from the imported folders with ``actor.optim.state_path`` and
``critic.optim.state_path``: the learner says it took both AdamW states, and trains (slow:
a real run, about a minute)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from relay.import_verl import main as import_verl

from ..tools.relay.test_import_verl import verl_checkpoint  # noqa: F401 - a fixture
from .conftest import launch, only_run_dir, small_run_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 3


def test_a_ppo_run_starts_from_verls_weights_and_adamw_state(
        verl_checkpoint: tuple[Path, Path], run_root: Path,  # noqa: F811
        tmp_path: Path) -> None:
    checkpoint, _ = verl_checkpoint
    out = tmp_path / "imported"
    assert import_verl([str(checkpoint), "--optimizer", str(out)]) == 0
    args = small_run_overrides(out, run_root, steps=STEPS) + [
        f"actor.optim.state_path={out / 'optimizer'}", "algorithm.adv_estimator=gae",
        f"critic.model.path={out / 'critic'}",
        f"critic.optim.state_path={out / 'critic' / 'optimizer'}",
        "trainer.test_freq=-1", "trainer.val_before_train=false"]
    result = launch(args, timeout_s=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = (only_run_dir(run_root) / "logs" / "learner.log").read_text()
    for key, part in (("actor.optim.state_path", "actor"), ("critic.optim.state_path",
                                                             "critic")):
        assert re.search(rf"{key}: AdamW state of \d+ parameters at step 1 from verl "
                         rf"{checkpoint.name}/{part} \(2 ranks\)", log), log[-3000:]
    summary = result.stdout[result.stdout.rindex("relay launch: run finished"):]
    assert summary.splitlines()[1].split()[:2] == ["steps", f"{STEPS}/{STEPS}"], summary
