"""The Slurm backend: the job script of a run, its job steps on the job's nodes, a step
started through ``srun``, submitting and following the job, and what Slurm refuses.

``srun``, ``scontrol``, ``sbatch`` and ``squeue`` are stand-ins on PATH (shell scripts), so
these tests need no Slurm; test_slurm_cluster.py runs a real one where it is installed."""

import os
import shutil
import stat
import sys
from pathlib import Path

import msgspec
import pytest

from relay.configs import DEFAULT_RUN, DEFAULT_TOPOLOGY, ConfigError
from relay.configs.checks import load_run_config, load_topology
from relay.configs.topology_schema import Topology
from relay.launch import main as launch_main
from relay.launcher.backends import backend_for
from relay.launcher.child import module_argv
from relay.launcher.plan import ProcessSpec
from relay.launcher.slurm import (
    NODE_RANK,
    StepDemand,
    SlurmStepBackend,
    layout,
    step_argv,
)
from relay.launcher.slurm_job import EXIT_CODE, final_code, follow, sbatch_script

GOLDEN = Path(__file__).parent / "golden"
RUN_DIR = Path("/scratch/relay/runs/relay-arithmetic-20261128-000000")
PYTHON = "/opt/relay/.venv/bin/python"
REPO = Path(__file__).resolve().parents[3]


def executable(folder: Path, name: str, text: str) -> None:
    path = folder / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``scontrol show hostnames`` naming gpu07..gpu09 and an ``srun`` that drops its
    options and runs the command, first on PATH, inside a job of nodes ``gpu[07-09]``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir, "scontrol", '#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[07-09]" ] '
                                    '&& printf "gpu07\\ngpu08\\ngpu09\\n"\n')
    executable(bin_dir, "srun", '#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\n'
                                'exec "$@"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-09]")
    return bin_dir


def golden_topology(tmp_path: Path) -> Topology:
    """tests/tools/launcher/golden/slurm-2x8.toml, beside an (empty) keys folder."""
    shutil.copy(GOLDEN / "slurm-2x8.toml", tmp_path / "topology.toml")
    (tmp_path / "keys").mkdir(exist_ok=True)
    return load_topology(tmp_path / "topology.toml")


def test_the_job_script_of_two_nodes_of_eight_gpus_is_the_reviewed_one(
        tmp_path: Path) -> None:
    script = sbatch_script(golden_topology(tmp_path), load_run_config(DEFAULT_RUN), RUN_DIR,
                           python=PYTHON)
    assert script == (GOLDEN / "slurm-2x8.sbatch").read_text()


def test_each_process_is_a_step_on_its_node_with_its_gpus(tmp_path: Path,
                                                          fake_slurm: Path) -> None:
    run = load_run_config(DEFAULT_RUN)
    topology = golden_topology(tmp_path)
    backend = backend_for(topology)
    assert isinstance(backend, SlurmStepBackend)
    backend.python = PYTHON
    topology = backend.place(topology, run)
    assert topology.learner.hosts == ["gpu07"] and topology.buffer.host == "gpu07"
    assert topology.launcher.host == "gpu07"  # the supervisor's node: the job's first
    assert [g.host for g in topology.generators] == ["gpu08", "gpu08"]
    assert topology.evaluator.host == "gpu08"
    assert 0 not in (topology.buffer.port, topology.learner.master_port,
                     topology.learner.weights_port, topology.launcher.metrics_port)
    run_dir = tmp_path / "run"
    steps = {spec.name: spec for spec in backend.plan(topology, run, run_dir)}
    assert list(steps) == ["buffer", "learner", "gen0", "gen1", "evaluator"]
    common = ["--run-dir", str(run_dir)]
    assert steps["learner"].argv == [
        "srun", "--exact", "--nodes=1", "--nodelist=gpu07", "--ntasks-per-node=1",
        "--gpus-per-task=8", "--cpus-per-task=64", "--mem=131072M", "--kill-on-bad-exit=1",
        *module_argv(PYTHON, "torch.distributed.run", "--nnodes=1", "--rdzv-backend=c10d",
                     "--rdzv-endpoint=127.0.0.1:0", f"--rdzv-id={run_dir.name}",
                     "--nproc-per-node=8", "--no-python",
                     *module_argv(PYTHON, "relay.learner.main", *common))]
    assert steps["gen0"].argv == [
        "srun", "--exact", "--nodes=1", "--nodelist=gpu08", "--ntasks=1", "--gpus-per-task=4",
        "--cpus-per-task=8", "--mem=0", "--kill-on-bad-exit=0",
        *module_argv(PYTHON, "relay.generators.main", *common, "--name", "gen0")]
    assert steps["gen0"].host == "gpu08" and not steps["gen0"].essential
    assert steps["evaluator"].argv[:9] == [
        "srun", "--exact", "--nodes=1", "--nodelist=gpu08", "--ntasks=1", "--gpus-per-task=2",
        "--cpus-per-task=4", "--mem=0", "--kill-on-bad-exit=0"]
    assert steps["buffer"].argv[:8] == ["srun", "--exact", "--nodes=1", "--nodelist=gpu07",
                                        "--ntasks=1", "--cpus-per-task=1", "--mem=0", PYTHON]


def test_a_learner_of_two_nodes_is_one_step_ranking_its_nodes_as_slurm_does(
        tmp_path: Path, fake_slurm: Path) -> None:
    topology = golden_topology(tmp_path)
    topology = msgspec.structs.replace(topology, learner=msgspec.structs.replace(
        topology.learner, nnodes=2, master_port=29600))
    run = load_run_config(DEFAULT_RUN)
    backend = SlurmStepBackend(python=PYTHON)
    topology = backend.place(topology, run)
    assert topology.learner.hosts == ["gpu07", "gpu08"]
    assert [g.host for g in topology.generators] == ["gpu09", "gpu09"]
    learner = [s for s in backend.plan(topology, run, tmp_path / "run") if s.role == "learner"]
    assert len(learner) == 1 and learner[0].name == "learner"
    argv = learner[0].argv
    assert argv[:9] == ["srun", "--exact", "--nodes=2", "--nodelist=gpu07,gpu08",
                        "--ntasks-per-node=1", "--gpus-per-task=8", "--cpus-per-task=64",
                        "--mem=131072M", "--kill-on-bad-exit=1"]
    assert argv[9:13] == ["sh", "-c", NODE_RANK, "sh"]
    assert argv[13:20] == module_argv(PYTHON, "torch.distributed.run", "--nnodes=2",
                                      "--master-addr=gpu07", "--master-port=29600")


def test_a_step_runs_its_process_through_srun_without_the_jobs_requests(
        tmp_path: Path, fake_slurm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_GPUS_PER_NODE", "8")  # the job's, not the step's request
    spec = ProcessSpec(name="gen0", role="generator", host="gpu08", essential=False,
                       env={"RELAY_TEST_VALUE": "from-the-plan"},
                       argv=[sys.executable, "-c", "import os; print(os.getpid(), "
                                                   "os.environ['RELAY_TEST_VALUE'], "
                                                   "os.environ.get('SLURM_GPUS_PER_NODE'))"])
    step = msgspec.structs.replace(spec, argv=step_argv(spec, StepDemand(gpus=0, cpus=1,
                                                                     memory_gib=0),
                                                        ["gpu08"]))
    log = tmp_path / "gen0.log"
    handle = SlurmStepBackend().start(step, Topology(), log)
    assert handle.wait() == 0 and handle.poll() == 0
    _pid, value, job_gpus = log.read_text().split()
    assert value == "from-the-plan" and job_gpus == "None"
    assert not handle.group_alive()


def test_what_slurm_decides_itself_is_refused_by_name(tmp_path: Path) -> None:
    topology = golden_topology(tmp_path)
    run = load_run_config(DEFAULT_RUN)
    replace = msgspec.structs.replace
    indexed = replace(topology, evaluator=replace(topology.evaluator, device="cuda:1"))
    with pytest.raises(ConfigError, match=r"evaluator\.device.*'cuda:1'.*picks each step's GPUs"):
        layout(indexed, run)
    too_big = replace(topology, learner=replace(topology.learner, nproc_per_node=16))
    with pytest.raises(ConfigError, match=r"learner node 0.*GPU.*gpus_per_node = 8"):
        layout(too_big, run)
    plain = replace(topology, security=replace(topology.security, curve=False))
    with pytest.raises(ConfigError, match=r"security\.curve.*2 nodes"):
        layout(plain, run)


def test_a_gpu_list_under_slurm_is_refused_before_anything_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    topology = tmp_path / "topology.toml"
    topology.write_text('[launcher]\nbackend = "slurm"\n\n[[generators]]\nname = "gen0"\n'
                        'device = "cuda"\ngpus = [0]\n')
    monkeypatch.chdir(REPO)
    assert launch_main([str(topology), str(DEFAULT_RUN), f"trainer.run_dir={tmp_path / 'runs'}",
                        "--dry-run"]) == 2
    assert "generators[0].gpus" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_the_embedded_default_fits_one_node_without_curve() -> None:
    topology = load_topology(DEFAULT_TOPOLOGY, ["launcher.backend=slurm"])
    plan = layout(topology, load_run_config(DEFAULT_RUN))
    assert (plan.nodes, plan.gpus_per_node, plan.cpus_per_node) == (1, 0, 4)


def test_a_launch_submits_the_script_and_follows_the_job_to_its_exit_code(
        tmp_path: Path, fake_slurm: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    executable(fake_slurm, "sbatch", '#!/bin/sh\nlogs=$(dirname "$2")/logs\n'
                                     'echo "step 2/2 | reward 0.50" > "$logs/slurm-42.out"\n'
                                     'echo 3 > "$logs/slurm-exit-code"\necho "42;c1"\n')
    executable(fake_slurm, "squeue", "#!/bin/sh\n")  # the job has ended
    monkeypatch.chdir(REPO)  # the embedded default's data files
    code = launch_main(["topology.launcher.backend=slurm", "trainer.total_training_steps=2",
                        f"trainer.run_dir={tmp_path / 'runs'}"])
    out = capsys.readouterr()
    assert code == 3, out
    assert "submitted job 42" in out.out and "step 2/2 | reward 0.50" in out.out
    run_dir = next((tmp_path / "runs").iterdir())
    script = (run_dir / "relay.sbatch").read_text()
    assert "#SBATCH --nodes=1" in script and f"--slurm-job {run_dir}" in script
    assert (run_dir / "topology.toml").is_file() and (run_dir / "run.toml").is_file()


def test_following_prints_the_output_as_it_grows_until_the_job_leaves_the_queue(
        tmp_path: Path, fake_slurm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "logs").mkdir()
    executable(fake_slurm, "squeue", f'#!/bin/sh\nn=$(cat {tmp_path}/polls 2>/dev/null || echo 0)'
                                     f'\necho $((n + 1)) > {tmp_path}/polls\n'
                                     f'echo "step $n" >> {tmp_path}/logs/slurm-7.out\n'
                                     f'[ $n -lt 2 ] && echo "RUNNING None"\n'
                                     f'[ $n -lt 2 ] || echo 0 > {tmp_path}/{EXIT_CODE}\n')
    assert follow("7", tmp_path, poll_s=0.01) == 0
    out = capsys.readouterr().out
    assert "job 7 RUNNING None" in out and "job 7 left the queue" in out
    assert out.index("step 0") < out.index("step 1") < out.index("step 2")


def test_a_job_killed_before_its_launcher_wrote_a_code_ends_as_slurm_says(
        tmp_path: Path, fake_slurm: Path) -> None:
    executable(fake_slurm, "scontrol", '#!/bin/sh\n[ "$*" = "show job --oneliner 9" ] && '
                                       'echo "JobId=9 JobState=CANCELLED Reason=None '
                                       'ExitCode=0:15"\n')
    assert final_code("9", tmp_path) == (143, "ended (CANCELLED) before its launcher wrote "
                                              "an exit code")
    (tmp_path / "logs").mkdir()
    (tmp_path / EXIT_CODE).write_text("130\n")  # the launcher's, stopped by scancel
    assert final_code("9", tmp_path) == (130, "ended (CANCELLED)")


def test_without_sbatch_a_launch_says_where_to_run_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.chdir(REPO)
    code = launch_main(["topology.launcher.backend=slurm", f"trainer.run_dir={tmp_path}"])
    assert code == 2
    assert "sbatch is not on PATH" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no run directory
