"""Relay as a user installs it: the wheel, built from what pyproject.toml maps, installed into a
fresh virtual environment, run from directories that are not the repository (slow: a venv
and its dependencies, then a real 3-step run; about 3-5 minutes with a warm pip cache).

What it proves (issue 31, item 1):
- the wheel holds one top-level package, ``relay``, with the configs' TOML and JSONL data and
  the ``relay`` command; the repository's folder names (``learner``, ``configs``, ...) are not
  importable from it;
- from an empty directory ``relay --help`` and ``relay launch --dry-run`` work and write
  nothing there;
- a 3-step run of the embedded default, started from a directory full of decoy packages named
  like Relay's modules and its dependencies (each raising on import), finishes, writes its
  outputs to the run directory it was given and nothing else into the working directory:
  no child process (buffer, learner, generator, evaluator, reward worker) imported a decoy.

``RELAY_TORCH_SPEC`` picks the torch installed first (default: the CPU wheel, as
``tools/with-venv`` does); the rest comes from the package index pip is configured with.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
TORCH_SPEC = os.environ.get("RELAY_TORCH_SPEC", "torch==2.13.0")
REPO_FOLDERS = ["learner", "generators", "buffer", "transport", "algorithms", "configs",
                "launcher", "tools"]
"""The repository's folder names: a wheel that installs one of them at top level shadows (or
is shadowed by) the user's own package of that name."""
DECOYS = ["relay", *REPO_FOLDERS, "torch", "transformers", "tokenizers", "numpy", "zmq",
          "msgspec", "mlflow", "safetensors", "math_verify", "runpy", "multiprocessing"]
"""Packages put in the working directory of the 3-step run, each raising on import: whatever a
process imports from its working directory instead of the installed package fails loudly."""
FREE_PORTS = ["topology.buffer.port=0", "topology.learner.weights_port=0",
              "topology.learner.weights_stream_port=0", "topology.launcher.metrics_port=0"]


def user_env(venv: Path | None = None) -> dict[str, str]:
    """This environment as a user's shell would have it with ``venv`` activated: no
    ``PYTHONPATH``, and no other venv (the checkout's, running the tests) on ``PATH``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    path = [p for p in env.get("PATH", os.defpath).split(os.pathsep)
            if not (Path(p) / "activate").is_file()]
    if venv is not None:
        path.insert(0, str(venv / "bin"))
    env["PATH"] = os.pathsep.join(path)
    return env


def run(argv: list[str], cwd: Path, timeout_s: float = 900,
        venv: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                          env=user_env(venv), stdin=subprocess.DEVNULL)


def checked(argv: list[str], cwd: Path, timeout_s: float = 900,
            venv: Path | None = None) -> str:
    """Run ``argv``; its output, or a failure that shows the output's tail."""
    done = run(argv, cwd, timeout_s, venv)
    assert done.returncode == 0, (f"{argv[:6]} exited {done.returncode}\n"
                                  f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done.stdout


def source_tree(dest: Path) -> Path:
    """A copy of what the build needs: pyproject.toml, its readme and the folders it maps into
    ``relay`` (nothing else of the checkout: a module it forgot to map cannot sneak in, and
    the build's own ``build/`` and ``*.egg-info`` stay out of the shared checkout)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = project["tool"]["setuptools"]["package-dir"].values()
    for name in ["pyproject.toml", "setup.cfg", project["project"]["readme"]]:
        shutil.copy2(ROOT / name, dest / name)
    for folder in folders:
        shutil.copytree(ROOT / folder, dest / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = source_tree(tmp_path_factory.mktemp("src"))
    dist = tmp_path_factory.mktemp("dist")
    checked([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir",
             str(dist), str(src)], cwd=dist)
    (built,) = dist.glob("relay_rl-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding torch (``TORCH_SPEC``) and the wheel with its dependencies."""
    venv = tmp_path_factory.mktemp("venv")
    here = wheel.parent
    checked([sys.executable, "-m", "venv", str(venv)], cwd=here)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    checked([*pip, TORCH_SPEC], cwd=here)
    checked([*pip, str(wheel)], cwd=here)
    return venv


@pytest.fixture
def empty_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "work"
    folder.mkdir()
    return folder


def test_the_wheel_holds_one_package_with_its_data_and_the_relay_command(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = archive.read(next(n for n in names if n.endswith("entry_points.txt")))
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"relay"}, f"stray top-level names in the wheel: {sorted(tops - {'relay'})}"
    for data in ["relay/configs/topology.toml", "relay/configs/arithmetic-grpo.toml",
                 "relay/configs/data/arithmetic-train.jsonl",
                 "relay/configs/data/arithmetic-test.jsonl"]:
        assert data in names, f"{data} is not in the wheel"
    assert "relay = relay.cli:main" in entry_points.decode()


def test_only_relay_is_importable_from_the_installed_wheel(venv: Path, empty_dir: Path) -> None:
    python = str(venv / "bin" / "python")
    checked([python, "-c", "import relay.learner.main, relay.launcher.supervisor"], empty_dir,
            venv=venv)
    for name in REPO_FOLDERS:
        done = run([python, "-c", f"import {name}"], empty_dir, venv=venv)
        assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, (
            f"`import {name}` worked: the wheel installs it at top level")


def test_help_and_dry_run_from_an_empty_directory_write_nothing(venv: Path,
                                                                 empty_dir: Path) -> None:
    relay = str(venv / "bin" / "relay")
    assert "launch" in checked([relay, "--help"], empty_dir, venv=venv)
    report = checked([relay, "launch", "--dry-run"], empty_dir, venv=venv)
    assert "relay.learner.main" in report and "relay.buffer.main" in report
    assert list(empty_dir.iterdir()) == []


def write_decoys(folder: Path) -> list[str]:
    """``DECOYS`` in ``folder``, packages (``runpy``, a module) that raise on import."""
    for name in DECOYS:
        raising = f"raise ImportError('the working directory\\'s decoy {name} was imported')\n"
        if name == "runpy":
            (folder / "runpy.py").write_text(raising)
        else:
            (folder / name).mkdir()
            (folder / name / "__init__.py").write_text(raising)
    return sorted(p.name for p in folder.iterdir())


def test_a_three_step_default_run_ignores_decoys_in_the_working_directory(
        venv: Path, empty_dir: Path) -> None:
    decoys = write_decoys(empty_dir)
    done = run([str(venv / "bin" / "relay"), "launch", "trainer.total_training_steps=3",
                "trainer.run_dir=out", "custom_reward_function.in_process_builtins=false",
                *FREE_PORTS], empty_dir, venv=venv)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "decoy" not in done.stdout + done.stderr
    assert sorted(p.name for p in empty_dir.iterdir()) == sorted([*decoys, "out"]), (
        "the run wrote into the working directory outside trainer.run_dir")
    (run_dir,) = (empty_dir / "out").iterdir()
    for made in ["run.toml", "topology.toml", "mlflow.db"]:
        assert (run_dir / made).is_file(), f"{made} missing from {sorted(os.listdir(run_dir))}"
    logs = {p.name: p.read_text(errors="replace") for p in run_dir.rglob("*.log")}
    assert {"learner.log", "buffer.log", "gen0.log"} <= set(logs), sorted(logs)
    assert not [name for name, text in logs.items() if "decoy" in text]
    history = metrics(run_dir, ["actor/loss", "rollout/reward_mean",
                                "buffer/samples/reward_errors"])
    assert max(history["actor/loss"]) == 3, history["actor/loss"]
    # scored in the reward worker (custom_reward_function.in_process_builtins=false), which
    # boots past the decoys too: no sample failed, and some were right
    assert not any(history["buffer/samples/reward_errors"].values()), history
    assert any(history["rollout/reward_mean"].values()), history


def metrics(run_dir: Path, keys: list[str]) -> dict[str, dict[int, float]]:
    """``{key: {step: value}}`` of the run's MLflow store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
            for key in keys}
