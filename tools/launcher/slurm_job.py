"""The Slurm backend from the login node: one ``sbatch`` script per run, submitted and
followed.

``tools/launch-cluster.py`` with ``launcher.backend = "slurm"`` resolves and checks the run
as for any backend, writes the resolved configs into the run directory, renders
``RUN_DIR/relay.sbatch`` (``sbatch_script``) from ``[launcher.slurm]`` and the plan's
layout (``relay.launcher.slurm.layout``: the nodes, GPUs and CPUs per node it needs),
submits it (``sbatch --parsable``) and follows the job (``follow``): its state from
``squeue``, the supervisor's status lines from the job's output
(``RUN_DIR/logs/slurm-<job id>.out``) as they come, and, once it has ended, its exit code
(from ``RUN_DIR/logs/slurm-exit-code``, which the script writes, else the job's state in
``scontrol`` or ``sacct``). Ctrl-C
stops following, not the job (``scancel <job id>`` does).

In the job, the script runs ``relay launch --slurm-job RUN_DIR`` (``run_job``) on the first
node: the supervisor of every backend, starting each process as an ``srun`` step
(``relay.launcher.slurm.SlurmStepBackend``). ``--dry-run`` prints the script and the
steps' command lines, ``NODEi`` standing for the job's i-th node.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from relay.configs.checks import load_run_config, load_topology
from relay.configs.loader import to_toml
from relay.configs.run_schema import RunConfig
from relay.configs.rundir import RESOLVED_RUN, RESOLVED_TOPOLOGY
from relay.configs.topology_schema import Topology
from relay.launcher.child import module_argv
from relay.launcher.resolve import ResolvedLaunch
from relay.launcher.slurm import Layout, layout, placed, slurm_plan

SCRIPT = "relay.sbatch"  # in the run directory
OUTPUT = "logs/slurm-%j.out"  # the job's output, in the run directory (%j: its id)
EXIT_CODE = "logs/slurm-exit-code"  # the supervisor's exit code, written by the script
SBATCH = "sbatch"
SCONTROL = "scontrol"
SQUEUE = "squeue"
SACCT = "sacct"
POLL_S = 5.0


class SlurmError(Exception):
    """Submitting or following the job failed: the message says how."""


def sbatch_options(topology: Topology, plan_layout: Layout, run_dir: Path) -> list[str]:
    """The ``#SBATCH`` options: ``[launcher.slurm]``'s, the nodes, GPUs, CPUs and memory per
    node of the layout, the output file, then ``sbatch``'s extra options as given."""
    settings = topology.launcher.slurm
    options = [f"--job-name={settings.job_name}"]
    options += [f"--{key}={value}" for key, value in (
        ("partition", settings.partition), ("account", settings.account),
        ("qos", settings.qos), ("time", settings.time)) if value]
    options += [f"--nodes={plan_layout.nodes}", "--ntasks-per-node=1",
                f"--cpus-per-task={max(plan_layout.cpus_per_node, 1)}"]
    if plan_layout.gpus_per_node:
        options.append(f"--gpus-per-node={plan_layout.gpus_per_node}")
    if plan_layout.memory_gib_per_node:
        options.append(f"--mem={int(plan_layout.memory_gib_per_node * 1024 + 0.999)}M")
    options.append(f"--output={run_dir / OUTPUT}")
    return [*options, *settings.sbatch]


def layout_lines(plan_layout: Layout) -> list[str]:
    """The layout as comment lines: which process runs where with what."""
    lines = []
    for name, demand in plan_layout.demand.items():
        nodes = plan_layout.learner_nodes if name == "learner" else [plan_layout.node_of[name]]
        where = f"node{'s' if len(nodes) > 1 else ''} {','.join(map(str, nodes))}"
        each = " each" if len(nodes) > 1 else ""
        memory = f", {demand.memory_gib:g} GiB" if demand.memory_gib else ""
        lines.append(f"#   {name:<12} {where:<10} {demand.gpus} GPU(s), "
                     f"{demand.cpus} CPU(s){memory}{each}")
    return lines


def sbatch_script(topology: Topology, run: RunConfig, run_dir: Path,
                  python: str = sys.executable, source: str = "the topology") -> str:
    """The job script of a run whose resolved configs are in ``run_dir`` (module
    docstring); ``ConfigError`` (naming ``source``) for a plan Slurm cannot place."""
    plan_layout = layout(topology, run, source)
    job = shlex.join(module_argv(python, "relay.launch", "--slurm-job", str(run_dir)))
    lines = ["#!/bin/bash",
             f"# Relay run {run_dir.name}: written by tools/launch-cluster.py "
             "(launcher.backend = \"slurm\").",
             "# The supervisor runs here, on the job's first node, and starts each process",
             "# as a job step (relay.launcher.slurm); the layout by node of the job:",
             *layout_lines(plan_layout),
             *(f"#SBATCH {option}" for option in sbatch_options(topology, plan_layout,
                                                                run_dir)),
             "",
             *topology.launcher.slurm.setup,
             "# SIGTERM (scancel, the time limit) reaches the launcher, which stops the run;",
             "# this shell outlives it to write its exit code.",
             "trap true TERM",
             job,
             "code=$?",
             f"echo $code > {shlex.quote(str(run_dir / EXIT_CODE))}",
             "exit $code",
             ""]
    return "\n".join(lines)


def dry_run_steps(topology: Topology, run: RunConfig, run_dir: Path,
                  python: str = sys.executable) -> list[str]:
    """Each job step's command line, the job's nodes named ``NODE0``, ``NODE1``..."""
    plan_layout = layout(topology, run)
    hosts = [f"NODE{i}" for i in range(plan_layout.nodes)]
    plan = slurm_plan(placed(topology, plan_layout, hosts), run, run_dir, plan_layout, hosts,
                      python)
    lines = []
    for spec in plan:  # srun passes on the environment it was started with
        env = "".join(f"{name}={shlex.quote(value)} " for name, value in sorted(spec.env.items()))
        lines.append(f"{spec.name}: {env}{shlex.join(spec.argv)}")
    return lines


def dry_run_text(resolved: ResolvedLaunch) -> str:
    """What ``--dry-run`` adds for Slurm: the script and the steps' command lines."""
    script = sbatch_script(resolved.topology, resolved.run, resolved.run_dir,
                           source=resolved.topology_file)
    steps = dry_run_steps(resolved.topology, resolved.run, resolved.run_dir)
    return "\n".join([f"# Slurm job script ({resolved.run_dir / SCRIPT}):", script,
                      "# Its job steps (NODEi: the job's i-th node; ports picked in the job):",
                      *steps])


def submit(resolved: ResolvedLaunch) -> str:
    """Write the resolved configs and the script into the run directory and submit it;
    the job's id. ``SlurmError`` when ``sbatch`` is missing or refuses it."""
    script = sbatch_script(resolved.topology, resolved.run, resolved.run_dir,
                           source=resolved.topology_file)  # ConfigError before any file
    if shutil.which(SBATCH) is None:
        raise SlurmError(f"{SBATCH} is not on PATH: launcher.backend = \"slurm\" submits the "
                         "run from a Slurm login node (--dry-run prints the job script)")
    run_dir = resolved.run_dir
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / RESOLVED_TOPOLOGY).write_bytes(to_toml(resolved.topology))
    (run_dir / RESOLVED_RUN).write_bytes(to_toml(resolved.run))
    (run_dir / SCRIPT).write_text(script)
    done = subprocess.run([SBATCH, "--parsable", str(run_dir / SCRIPT)], capture_output=True,
                          text=True, timeout=120)
    job_id = done.stdout.strip().split(";")[0]  # "id;cluster" on a federation
    if done.returncode != 0 or not job_id:
        raise SlurmError(f"{SBATCH} {run_dir / SCRIPT} failed (exit code {done.returncode}): "
                         f"{done.stderr.strip() or done.stdout.strip()}")
    return job_id


def job_state(job_id: str) -> str:
    """The job's state in ``squeue`` (``PENDING``, ``RUNNING``...; with the reason while it
    waits), or "" once it has left the queue."""
    done = subprocess.run([SQUEUE, "--noheader", "--jobs", job_id, "--format", "%T %R"],
                          capture_output=True, text=True, timeout=60)
    return done.stdout.strip() if done.returncode == 0 else ""


def ended_state(job_id: str) -> tuple[str, str] | None:
    """The ended job's state and exit code (``CANCELLED``, ``0:15``): ``scontrol``'s, which
    keeps a job MinJobAge (300 s by default) after it ended, else ``sacct``'s; None when
    neither knows it."""
    if shutil.which(SCONTROL):
        done = subprocess.run([SCONTROL, "show", "job", "--oneliner", job_id],
                              capture_output=True, text=True, timeout=60)
        state = re.search(r"\bJobState=(\S+)", done.stdout)
        code = re.search(r"\bExitCode=(\S+)", done.stdout)
        if done.returncode == 0 and state and code:
            return state[1], code[1]
    if shutil.which(SACCT):
        done = subprocess.run([SACCT, "--noheader", "--parsable2", "--allocations",
                               "--jobs", job_id, "--format", "State,ExitCode"],
                              capture_output=True, text=True, timeout=60)
        rows = done.stdout.split()
        if done.returncode == 0 and rows and "|" in rows[0]:
            state, code = rows[0].split("|", 1)
            return state, code
    return None


def final_code(job_id: str, run_dir: Path) -> tuple[int, str]:
    """The ended job's exit code, and how it ended: the supervisor's, as the script wrote it,
    else from the job's state (a job that ended before its supervisor could say: a node
    failed, the job was killed)."""
    ended = ended_state(job_id)
    try:
        return int((run_dir / EXIT_CODE).read_text().strip()), \
            f"ended ({ended[0]})" if ended else "ended"
    except (OSError, ValueError):
        pass
    if ended is None:
        return 1, ("ended without writing its exit code, and neither scontrol nor sacct "
                   "knows the job")
    state, code = ended
    exit_code, _, sig = code.partition(":")
    number = int(exit_code) if exit_code.isdigit() else 0
    if not number and state != "COMPLETED":
        number = 128 + int(sig) if sig.isdigit() and int(sig) else 1
    return number, f"ended ({state}) before its launcher wrote an exit code"


def follow(job_id: str, run_dir: Path, poll_s: float = POLL_S) -> int:
    """Print the job's state changes and its output as it grows until the job has ended;
    its exit code. Ctrl-C stops following (130), not the job."""
    output = run_dir / OUTPUT.replace("%j", job_id)
    print(f"relay launch: submitted job {job_id}; output in {output}", flush=True)
    last_state, offset = None, 0
    try:
        while True:
            state = job_state(job_id)
            if state != last_state:
                print(f"relay launch: job {job_id} {state or 'left the queue'}", flush=True)
                last_state = state
            offset = print_new(output, offset)
            if not state:
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        print(f"\nrelay launch: stopped following job {job_id}; it goes on (scancel {job_id} "
              f"stops it; its output: {output})", file=sys.stderr, flush=True)
        return 130
    print_new(output, offset)
    code, how = final_code(job_id, run_dir)
    print(f"relay launch: job {job_id} {how}: exit code {code}", flush=True,
          file=sys.stdout if code == 0 else sys.stderr)
    return code


def print_new(path: Path, offset: int) -> int:
    """Print what ``path`` holds past ``offset``; the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            new = f.read()
    except OSError:
        return offset
    if new:
        sys.stdout.write(new.decode(errors="replace"))
        sys.stdout.flush()
    return offset + len(new)


def run_job(run_dir: Path) -> int:
    """In the job: the run directory's resolved configs launched by the supervisor, every
    process a job step (``relay.launcher.slurm.SlurmStepBackend``)."""
    from relay.launcher.supervisor import launch

    run_dir = run_dir.resolve()
    topology_file, run_file = run_dir / RESOLVED_TOPOLOGY, run_dir / RESOLVED_RUN
    resolved = ResolvedLaunch(topology_file=str(topology_file), run_file=str(run_file),
                              topology=load_topology(topology_file),
                              run=load_run_config(run_file), run_dir=run_dir, processes=[])
    return launch(resolved)
