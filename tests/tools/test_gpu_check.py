"""tools/gpu-check.py: the wheels it takes to a GPU machine (chosen here without the network),
its verdicts, and its checks run here on the CPU (``--device cpu``) with their JSON summary.
Check C (a 30-step launch-cluster run, about 2 minutes here) is in the slow tier."""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu-check.py"
PACKAGE = ROOT / "tools" / "gpucheck"

if "gpucheck" not in sys.modules:  # tools/gpucheck, as tools/gpu-check.py imports it
    _spec = importlib.util.spec_from_file_location("gpucheck", PACKAGE / "__init__.py",
                                                   submodule_search_locations=[str(PACKAGE)])
    sys.modules["gpucheck"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["gpucheck"])

from gpucheck import learner_check, wheels  # noqa: E402
from gpucheck.cluster_check import cluster_checks  # noqa: E402
from gpucheck.report import CheckResult, Report  # noqa: E402

MISSING_ON_THE_GPU_MACHINE = {"msgspec", "pyzmq", "tomli-w", "torchdata", "mlflow-skinny",
                              "sqlalchemy", "alembic", "math-verify"}
"""Relay's dependencies the GPU machine lacks, and the store mlflow-skinny's sqlite URI needs."""


def run_tool(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=ROOT)


# -- the wheels ---------------------------------------------------------------------------

def test_the_wheels_are_relays_missing_dependencies_and_all_they_need() -> None:
    environment = wheels.target_environment()
    pins = wheels.carried(wheels.runtime_requirements(ROOT / "pyproject.toml", environment),
                          environment=environment)
    assert MISSING_ON_THE_GPU_MACHINE <= set(pins)
    assert "mlflow" not in pins and not set(pins) & wheels.GPU_MACHINE_HAS
    assert not [n for n in pins if n in ("torch", "triton") or n.startswith(("nvidia", "cuda"))]
    assert all(pins[name] == metadata.version(name) for name in pins)
    for name in pins:  # whatever a carried wheel needs is carried or already there
        for line in metadata.requires(name) or []:
            need = Requirement(line)
            if need.marker is None or need.marker.evaluate(environment):
                assert canonicalize_name(need.name) in (set(pins) | wheels.GPU_MACHINE_HAS), \
                    f"{name} needs {need.name}"


def fake_metadata(versions: dict[str, str], requires: dict[str, list[str]]):
    def version_of(name: str) -> str:
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    return dict(version_of=version_of, requires_of=requires.get)


def test_requirements_follow_markers_and_mlflow_comes_as_skinny_with_its_store() -> None:
    versions = {"relay-dep": "1.0", "needed": "2.0", "old-python-only": "0.1",
                "mlflow-skinny": "3.1", "sqlalchemy": "2.0", "alembic": "1.1"}
    requires = {"relay-dep": ["needed>=1", "numpy", "winreg-helper; sys_platform == 'win32'",
                              "old-python-only; python_version < '3.12'",
                              "docs-tool; extra == 'docs'"]}
    found = fake_metadata(versions, requires)
    pins = wheels.carried(["relay-dep", "mlflow"], environment=wheels.target_environment("3.12"),
                          **found)
    assert pins == {"alembic": "1.1", "mlflow-skinny": "3.1", "needed": "2.0",
                    "relay-dep": "1.0", "sqlalchemy": "2.0"}
    older = wheels.carried(["relay-dep"], environment=wheels.target_environment("3.11"),
                           **found)
    assert "old-python-only" in older


def test_cuda_packages_and_packages_missing_here_are_refused_by_name() -> None:
    found = fake_metadata({"a-cuda12-kernel": "1.0"},
                          {"a-cuda12-kernel": ["nvidia-nccl-cu12==2.21"]})
    with pytest.raises(RuntimeError, match="nvidia-nccl-cu12 would be carried"):
        wheels.carried(["a-cuda12-kernel"], environment=wheels.target_environment(), **found)
    with pytest.raises(RuntimeError, match="not-here is needed on the GPU machine"):
        wheels.carried(["not-here"], environment=wheels.target_environment(), **found)


def test_the_download_asks_for_exactly_these_wheels_for_the_gpu_machine(tmp_path: Path) -> None:
    command = wheels.download_command({"msgspec": "0.22.0", "tomli-w": "1.2.0"}, tmp_path)
    assert command[1:4] == ["-m", "pip", "download"]
    for flag in ("--no-deps", "--only-binary=:all:"):
        assert flag in command
    assert command[command.index("--python-version") + 1] == "3.12"
    assert command[command.index("--implementation") + 1] == "cp"
    platforms = {command[i + 1] for i, arg in enumerate(command) if arg == "--platform"}
    assert {"manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_39_x86_64"} <= platforms
    assert command[command.index("--dest") + 1] == str(tmp_path)
    assert command[-2:] == ["msgspec==0.22.0", "tomli-w==1.2.0"]


def test_two_versions_of_one_wheel_are_refused(tmp_path: Path) -> None:
    for version in ("1.0", "1.1"):
        (tmp_path / f"probe-{version}-py3-none-any.whl").touch()
    with pytest.raises(RuntimeError, match="probe 1.0 and 1.1"):
        wheels.wheel_versions(tmp_path)


def write_wheel(folder: Path, name: str, source: str) -> Path:
    """A minimal pure-Python wheel holding the module ``name``."""
    info = f"{name}-1.0.dist-info"
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{name}.py", source)
        archive.writestr(f"{info}/METADATA",
                         f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                          "Root-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", f"{name}.py,,\n{info}/METADATA,,\n"
                                           f"{info}/WHEEL,,\n{info}/RECORD,,\n")
    return wheel


def test_wheels_install_offline_onto_the_path_of_child_processes(tmp_path: Path,
                                                                 monkeypatch) -> None:
    folder = tmp_path / "wheels"
    folder.mkdir()
    assert wheels.install(folder, tmp_path / "empty-site") == []  # nothing to install
    write_wheel(folder, "relay_gpu_check_probe", "VALUE = 42\n")
    site = tmp_path / "site"
    assert wheels.install(folder, site) == ["relay_gpu_check_probe-1.0-py3-none-any.whl"]
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    wheels.activate([site, ROOT])
    child = subprocess.run([sys.executable, "-c", "import relay_gpu_check_probe as p; "
                            "print(p.VALUE)"], capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == "42", child.stderr
    assert sys.path[:2] == [str(site), str(ROOT)]
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(site), str(ROOT), "/elsewhere"]



def test_relay_travels_as_a_wheel_that_the_checkouts_scripts_import(tmp_path: Path) -> None:
    """The GPU machine has no editable install: Relay's own wheel, installed with the others,
    is the ``relay`` that ``tools/launch-cluster.py`` (run by path, as check C does) and this
    script's workers (checks A and B) import, not the checkout's tools/relay/ beside them."""
    folder = tmp_path / "wheels"
    subprocess.run(wheels.relay_wheel_command(ROOT, folder), check=True, timeout=300)
    (wheel,) = folder.glob("*.whl")
    assert wheel.name.startswith("relay_rl-")
    site = tmp_path / "site"
    wheels.install(folder, site)
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONVERBOSE": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "launch-cluster.py"),
                           "--dry-run"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{site}/relay/launch.py" in done.stderr
    assert str(ROOT / "tools" / "relay" / "launch.py") not in done.stderr
    # a worker whose device is refused after its imports: the installed relay.learner
    task = tmp_path / "task.json"
    task.write_text(json.dumps({"kind": "learner", "model": str(tmp_path), "dtypes": [],
                                "device": "no-such-device", "out": str(tmp_path / "out")}))
    worker = subprocess.run([sys.executable, str(TOOL), "--worker", str(task)],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert f"{site}/relay/learner/model.py" in worker.stderr, worker.stderr[-3000:]

# -- verdicts -----------------------------------------------------------------------------

def test_a_failing_check_leaves_the_others_and_the_summary_says_so(tmp_path: Path) -> None:
    report = Report({"device": "cpu"})

    def broken() -> list[CheckResult]:
        raise ValueError("a deliberate failure")

    report.run("X", broken)
    report.run("Y", lambda: [CheckResult(name="Y/one", passed=True,
                                         numbers={"err": math.nan})])
    report.write(tmp_path / "summary.json")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is False
    first, second = summary["checks"]
    assert first["name"] == "X" and not first["passed"]
    assert "ValueError: a deliberate failure" in first["error"]
    assert second["passed"] and second["numbers"] == {"err": "nan"}  # strict JSON


def test_a_failed_run_leaves_its_logs_beside_the_summary(tmp_path: Path) -> None:
    from gpucheck.cli import LOGS_ARCHIVE, finish

    work, out = tmp_path / "work", tmp_path / "out"
    (work / "runs" / "r").mkdir(parents=True)
    (work / "runs" / "r" / "learner.log").write_text("the learner's last words\n")
    report = Report({"device": "cpu"})
    report.add(CheckResult(name="Z", passed=True))
    assert finish(report, out / "gpu-check.json", work) == 0
    assert not (out / LOGS_ARCHIVE).exists()
    report.add(CheckResult.failure("Z/two", "broken"))
    assert finish(report, out / "gpu-check.json", work) == 1
    with tarfile.open(out / LOGS_ARCHIVE) as archive:
        assert archive.getnames() == ["runs/r/learner.log"]


def outcome(seed: int = 0) -> dict:
    """A worker's outcome for one scenario, as ``learner_check._step`` returns it."""
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.rand(4, 6, generator=generator) > 0.3).float()
    return {"logprobs": -5 * torch.rand(4, 6, generator=generator) * mask,
            "entropy": 5 * torch.rand(4, 6, generator=generator) * mask, "mask": mask,
            "weights": {"w": torch.randn(8, generator=generator)},
            "moments": {"w": 1e-3 * torch.randn(8, generator=generator)},
            "moved": 4e-6, "metrics": {"actor/loss": 0.25, "actor/grad_norm": 1.5},
            "misplaced": [], "gradients": 1, "syncs": 3, "sync_sites": [], "peak_gib": None}


def spoil(run: dict, how: str) -> None:
    mask = run["mask"] > 0
    if how == "logprobs":
        run["logprobs"][mask] += 2 * learner_check.LOGPROB_TOL
    elif how == "weights":
        run["weights"]["w"][0] += 2 * learner_check.WEIGHT_TOL
    elif how == "gradients":
        run["moments"]["w"][0] += 2e-3 * float(run["moments"]["w"].abs().max())
    elif how == "loss":
        run["metrics"]["actor/loss"] += 2 * learner_check.LOSS_TOL
    elif how == "unmoved":
        run["moved"] = 0.0
    elif how == "misplaced":
        run["misplaced"] = ["actor w: exp_avg on cpu, not cuda:0"]


@pytest.mark.parametrize("how", ["logprobs", "weights", "gradients", "loss", "unmoved",
                                 "misplaced"])
def test_a_device_step_unlike_the_cpus_fails(how: str) -> None:
    assert learner_check.compare("s", outcome(), outcome(), outcome()).passed
    spoiled = outcome()
    spoil(spoiled, how)
    verdict = learner_check.compare("s", outcome(), spoiled, outcome())
    assert not verdict.passed and verdict.error


def test_bf16_far_from_fp32_or_not_finite_fails() -> None:
    far, infinite = outcome(), outcome()
    far["logprobs"][far["mask"] > 0] += 2 * learner_check.BF16_TOL
    infinite["metrics"]["actor/grad_norm"] = math.inf
    for bf16 in (far, infinite):
        assert not learner_check.compare("s", outcome(), outcome(), bf16).passed


def test_a_scenario_whose_extra_is_missing_is_skipped_saying_so(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = learner_check.Scenario("zero", ("actor.strategy=deepspeed",), needs="no_such_mod")
    monkeypatch.setattr(learner_check, "SCENARIOS", (missing,))
    try:
        outcomes = learner_check.learner_worker(tmp_path, "cpu", ["float32", "bfloat16"])
    finally:
        dist.destroy_process_group()
    assert outcomes == {f"zero:{d}": {"skipped": "no_such_mod is not installed on cpu"}
                        for d in ("float32", "bfloat16")}

    class Finished:
        def result(self) -> dict:
            return outcomes

    class Workers:
        def start(self, *_: object, **__: object) -> Finished:
            return Finished()

    (verdict,) = learner_check.learner_checks(Workers(), "cuda")  # type: ignore[arg-type]
    assert verdict.passed and verdict.skipped == "no_such_mod is not installed on cpu"


@pytest.mark.usefixtures("one_rank_group")
def test_an_engine_that_ignores_the_new_weights_fails_check_b(random_model_dir: Path) -> None:
    from gpucheck.build import check_learner, cpu_copy, host_batch, synthetic_groups
    from gpucheck.weights_check import LR, swap_in_flight

    cpu = torch.device("cpu")
    learner = check_learner(random_model_dir, cpu, "float32", ["actor.use_kl_loss=true"], lr=LR)
    learner.step(host_batch(synthetic_groups(learner.model.config.vocab_size), cpu))
    trained = {n: cpu_copy(p) for n, p in learner.model.named_parameters()}
    initial = {n: cpu_copy(p) for n, p in learner.reference.named_parameters()}
    swapped = swap_in_flight("lean", learner, trained, random_model_dir, cpu, "float32")
    assert swapped.passed, swapped.error
    ignored = swap_in_flight("lean", learner, initial, random_model_dir, cpu, "float32")
    assert not ignored.passed and "logprob_err" in ignored.error
    assert ignored.numbers["v1_err"] > 10 * swapped.numbers["v1_err"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_swaps_a_version_mid_run_on_its_cpu_build(tmp_path: Path) -> None:
    """Check B's vLLM part, which gpu-check runs on a GPU only, on vLLM's CPU build (about a
    minute here): the same code before a GPU is reached. vLLM's engine, once shut down,
    destroys the process's default group, so the test makes and ends its own."""
    import gc

    import torch.distributed as dist

    from gpucheck.build import check_learner, cpu_copy, host_batch, init_one_rank_group, \
        save_random_qwen2, synthetic_groups
    from gpucheck.weights_check import LOGPROB_TOL, LR, swap_in_flight

    cpu = torch.device("cpu")
    model = save_random_qwen2(tmp_path / "model")  # head_dim 32, as vLLM's CPU build needs
    init_one_rank_group(cpu)
    try:
        learner = check_learner(model, cpu, "float32", ["actor.use_kl_loss=true"], lr=LR)
        learner.step(host_batch(synthetic_groups(learner.model.config.vocab_size), cpu))
        trained = {n: cpu_copy(p) for n, p in learner.model.named_parameters()}
        swapped = swap_in_flight("vllm", learner, trained, model, cpu, "float32")
    finally:
        gc.collect()  # the engine's shutdown
        if dist.is_initialized():
            dist.destroy_process_group()
    assert swapped.passed, swapped.error
    assert swapped.numbers["logprob_err"] < LOGPROB_TOL["float32"] / 100


def test_a_run_that_does_not_start_fails_check_c_with_its_output(tmp_path: Path) -> None:
    (result,) = cluster_checks(ROOT, tmp_path / "no-model", tmp_path, "cpu", timeout_s=120)
    assert not result.passed
    assert result.error.startswith("exit 2") and "model.path" in result.error


def test_bad_options_are_refused() -> None:
    refused = run_tool("--only", "A,D", timeout_s=120)
    assert refused.returncode == 2 and "--only takes some of A,B,C" in refused.stderr


# -- the checks on the CPU ----------------------------------------------------------------

def summary_of(result: subprocess.CompletedProcess, path: Path) -> dict[str, dict]:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = json.loads(path.read_text())
    assert summary["passed"] and summary["environment"]["device"] == "cpu"
    return {check["name"]: check for check in summary["checks"]}


def test_learner_and_weight_checks_pass_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    checks = summary_of(run_tool("--device", "cpu", "--only", "A,B", "--out", str(out),
                                 timeout_s=900), out)
    scenarios = [s.name for s in learner_check.SCENARIOS]
    assert [n for n in checks if n.startswith("A/")] == [f"A/{s}" for s in scenarios]
    for name in scenarios:
        numbers = checks[f"A/{name}"]["numbers"]
        assert numbers["misplaced"] == 0 and numbers["gradients"] > 0
        assert numbers["moved"] >= learner_check.LR / 2
        assert numbers["logprob_err"] <= learner_check.LOGPROB_TOL
        assert 0 < numbers["bf16_logprob_err"] <= learner_check.BF16_TOL  # bf16 did run
        assert numbers["syncs"] >= 0 and numbers["peak_gib"] is None  # no GPU memory here
    for dtype in ("float32", "bfloat16"):
        publish = checks[f"B/publish:{dtype}"]["numbers"]
        assert publish["bytes"] > 0 and publish["gb_per_s"] > 0
        reward_model = checks[f"B/reward-model:{dtype}"]
        assert reward_model["passed"] and reward_model["numbers"]["sequences"] == 7
        lean = checks[f"B/lean:{dtype}"]["numbers"]
        assert min(lean["tokens_v0"], lean["tokens_v1"], lean["tokens_in_flight"]) > 0
        assert lean["version_gap"] > 10 * lean["logprob_err"]
    assert checks["B/vllm"]["skipped"]


@pytest.mark.slow
@pytest.mark.e2e
def test_the_launcher_check_passes_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    checks = summary_of(run_tool("--device", "cpu", "--only", "C", "--out", str(out),
                                 timeout_s=900), out)
    numbers = checks["C/launch-cluster"]["numbers"]
    assert numbers["steps_logged"] == 30 and numbers["version"] >= 1
    assert numbers["evaluations"] >= 1 and numbers["max_grad_norm"] > 0
