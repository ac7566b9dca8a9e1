"""Resolve what a launch would do: both configs checked, the run directory, the process plan.

``resolve_launch`` refuses a bad topology, run config or override before anything starts;
``dry_run_report`` prints the result for ``tools/launch-cluster.py --dry-run``.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

import msgspec

from algorithms.rewards.registry import UnknownDataSourceError, check_data_sources
from buffer.dataset import DatasetError, load_prompt_rows
from configs.checks import load_run_config, load_topology
from configs.loader import ConfigError
from configs.run_schema import RunConfig
from configs.topology_schema import Topology
from launcher.plan import ProcessSpec, build_plan, new_run_dir


class ResolvedLaunch(msgspec.Struct, kw_only=True, frozen=True):
    """Everything a launch needs, already validated."""

    topology_file: str
    run_file: str
    topology: Topology
    run: RunConfig
    run_dir: Path
    processes: list[ProcessSpec]


def resolve_launch(topology_file: str, run_file: str, topology_overrides: Sequence[str] = (),
                   run_overrides: Sequence[str] = ()) -> ResolvedLaunch:
    """Load and check both configs with their overrides; plan the processes."""
    topology = load_topology(topology_file, topology_overrides)
    run = load_run_config(run_file, run_overrides)
    check_validation_data(run, run_file)
    run_dir = new_run_dir(run)
    return ResolvedLaunch(topology_file=topology_file, run_file=run_file, topology=topology,
                          run=run, run_dir=run_dir,
                          processes=build_plan(topology, run, run_dir))


def check_validation_data(run: RunConfig, source: str) -> None:
    """The held-out rows load and each has a reward: the evaluator, which is not essential,
    would otherwise fail after the launch and the run go on without evaluation."""
    if not run.evaluates:
        return
    try:
        rows = load_prompt_rows(run.data.val_files)
        if not run.custom_reward_function.path:
            check_data_sources({row.data_source for row in rows})
    except (DatasetError, UnknownDataSourceError) as exc:
        raise ConfigError(source, "data.val_files", str(exc)) from exc


def dry_run_report(resolved: ResolvedLaunch) -> str:
    """The resolved configs as TOML and the processes that would start, for a person."""
    topology_toml = msgspec.toml.encode(resolved.topology).decode()
    run_toml = msgspec.toml.encode(resolved.run).decode()
    ssh = resolved.topology.launcher.ssh
    workdir = resolved.topology.launcher.remote_workdir
    lines = [
        f"# Resolved topology (from {resolved.topology_file})",
        topology_toml,
        f"# Resolved run config (from {resolved.run_file})",
        run_toml,
        f"# Run directory: {resolved.run_dir}",
        f"# Processes ({len(resolved.processes)}):",
    ]
    width = max(len(p.name) for p in resolved.processes)
    for proc in resolved.processes:
        kind = "essential" if proc.essential else "optional"
        command = shlex.join(proc.command_line(ssh, workdir))
        lines.append(f"  {proc.name:<{width}}  {proc.role:<9} {proc.host:<15} {kind:<9} {command}")
    return "\n".join(lines)
