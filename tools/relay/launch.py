"""Launch a Relay run: the buffer, the learner (torchrun) and the generators.

    python tools/launch-cluster.py [TOPOLOGY.toml] [RUN.toml] [key=value ...] [--dry-run]
    python tools/launch-cluster.py --resume RUN_DIR [key=value ...] [--dry-run]

With no config, the embedded default (configs/topology.toml, configs/arithmetic-grpo.toml).
Overrides ``section.key=value`` apply to the run config; ``topology.section.key=value`` to the
topology. verl's key paths work as written (``actor_rollout_ref.actor.clip_ratio_high=0.28``,
``trainer.n_gpus_per_node=8``, Hydra's ``+key=value``): configs/verl-keys.md says what each
becomes; a launch writes what each became to ``RUN_DIR/verl-keys.txt`` and prints the first
few. A bad config is refused before anything starts (a broken training or validation file, a
value from the command line named as such, a run config given first where the topology goes,
a device that is not ``cpu``, ``cuda`` or ``cuda:N``); ``model.path`` (and the critic's, the
reward model's) may be a ``builtin:`` model, a local folder or a Hub ID, resolved once here
(``relay.configs.hub``); a process on this machine's GPUs whose memory plan does not fit its
GPU is warned about (``relay.launcher.memory``). ``--dry-run`` prints the resolved configs and
the processes that would start, and exits. verl's ``--config-path DIR --config-name NAME``
(a recipe's Hydra config file, ``DIR/NAME.yaml``, over verl's ``ppo_trainer`` defaults) reads
that file's keys as overrides placed before the command line's, so the command line wins.
With ``launcher.backend = "slurm"`` the launch becomes one Slurm job: the run directory and
its job script ``RUN_DIR/relay.sbatch`` are written, the script is submitted with ``sbatch``
and the job followed from here until it ends (``relay.launcher.slurm_job``; ``--dry-run``
prints the script and its job steps).
``--resume RUN_DIR`` continues the run in RUN_DIR from its newest complete checkpoint, with
the configs stored there (and any overrides, e.g. more ``trainer.total_training_steps``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

from relay.configs import DEFAULT_RUN, DEFAULT_TOPOLOGY, ConfigError
from relay.configs.rundir import VERL_KEYS
from relay.launcher.memory import memory_warnings
from relay.launcher.resolve import (
    ResolvedLaunch,
    dry_run_report,
    resolve_launch,
    resolve_resume,
)

TOPOLOGY_PREFIX = "topology."
NOTES_SHOWN = 5  # verl-key notes printed at a real launch; the rest are in RUN_DIR/verl-keys.txt


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [TOPOLOGY.toml] [RUN.toml] [key=value ...]\n"
                                           "       %(prog)s --resume RUN_DIR [key=value ...]")
    parser.add_argument("items", nargs="*", metavar="ARG",
                        help="config files (topology first, then run) and key=value overrides")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved configs and the processes, start nothing")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its newest complete checkpoint")
    parser.add_argument("--slurm-job", metavar="RUN_DIR", help=argparse.SUPPRESS)
    # inside the Slurm job its script submitted: launch RUN_DIR's resolved configs
    parser.add_argument("--config-path", metavar="DIR",
                        help="verl's Hydra config folder (with --config-name)")
    parser.add_argument("--config-name", metavar="NAME",
                        help="verl's Hydra config DIR/NAME.yaml: its keys are overrides "
                             "before the command line's")
    args = parser.parse_intermixed_args(argv)  # `--dry-run` anywhere among the overrides
    files = [a for a in args.items if "=" not in a]
    overrides = [a for a in args.items if "=" in a]
    if args.config_name:
        try:
            overrides = hydra_file_overrides(Path(args.config_path or "."),
                                             args.config_name) + overrides
        except ConfigError as exc:
            parser.error(str(exc))
    elif args.config_path:
        parser.error("--config-path needs --config-name (the file DIR/NAME.yaml)")
    if len(files) > 2:
        parser.error(f"at most two config files (topology, run); got {files}")
    if args.resume and files:
        parser.error(f"--resume takes the configs stored in the run directory; got {files}")
    args.topology = files[0] if files else str(DEFAULT_TOPOLOGY)
    args.run = files[1] if len(files) > 1 else str(DEFAULT_RUN)
    args.topology_overrides = [o.removeprefix(TOPOLOGY_PREFIX) for o in overrides
                               if o.startswith(TOPOLOGY_PREFIX)]
    args.run_overrides = [o for o in overrides if not o.startswith(TOPOLOGY_PREFIX)]
    return args


def hydra_file_overrides(config_dir: Path, name: str) -> list[str]:
    """The keys of verl's Hydra config ``config_dir/name.yaml`` as ``key=value`` overrides
    (values as TOML text). Its ``defaults`` may name only verl's ``ppo_trainer`` (which
    Relay's defaults stand for) and ``_self_``; its ``hydra`` section is Hydra's own."""
    import json

    import yaml

    path = config_dir / (name if name.endswith(".yaml") else f"{name}.yaml")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(str(path), "--config-name", f"cannot read it: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "--config-name", "expected a mapping of verl's keys")
    defaults = data.pop("defaults", [])
    unknown = [d for d in defaults or [] if d not in ("ppo_trainer", "_self_")]
    if unknown:
        raise ConfigError(str(path), "defaults", f"{unknown}: only verl's ppo_trainer (and "
                          "_self_) can be built on; put those configs' keys in the file")
    data.pop("hydra", None)

    def flatten(node: Any, prefix: str) -> list[str]:
        if isinstance(node, dict) and node:
            return [o for key, value in node.items() for o in flatten(value, f"{prefix}{key}.")]
        text = node if isinstance(node, str) else "null" if node is None else json.dumps(node)
        return [f"{prefix[:-1]}={text}"]

    return flatten(data, "")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="relay launch: %(message)s")
    if args.slurm_job:
        from relay.launcher.slurm_job import run_job

        try:
            return run_job(Path(args.slurm_job))
        except ConfigError as exc:
            print(f"relay launch: config error: {exc}", file=sys.stderr)
            return 2
    try:
        if args.resume:
            resolved = resolve_resume(args.resume, args.topology_overrides, args.run_overrides)
        else:
            resolved = resolve_launch(args.topology, args.run, args.topology_overrides,
                                      args.run_overrides)
        slurm = resolved.topology.launcher.backend == "slurm"
        if slurm:  # a plan the job cannot hold is refused before anything is written
            from relay.launcher.slurm import layout

            layout(resolved.topology, resolved.run, resolved.topology_file)
    except ConfigError as exc:
        print(f"relay launch: config error: {exc}", file=sys.stderr)
        return 2
    for warning in memory_warnings(resolved.run, resolved.topology, resolved.run_file):
        logging.warning(warning)
    if args.dry_run:
        print(dry_run_report(resolved))
        if slurm:
            from relay.launcher.slurm_job import dry_run_text

            print(dry_run_text(resolved))
        return 0
    if resolved.run.trainer.resume_mode == "resume_path":
        print(f"relay launch: resuming from {resolved.run.trainer.resume_from_path}",
              flush=True)
    if slurm:
        from relay.launcher.slurm_job import SlurmError, follow, submit

        try:
            job_id = submit(resolved)  # nothing written when sbatch is missing
        except SlurmError as exc:
            print(f"relay launch: {exc}", file=sys.stderr)
            return 2
        report_verl_keys(resolved, resumed=bool(args.resume))
        return follow(job_id, resolved.run_dir)
    report_verl_keys(resolved, resumed=bool(args.resume))
    from relay.launcher.supervisor import launch

    return launch(resolved)


def report_verl_keys(resolved: ResolvedLaunch, resumed: bool) -> Path:
    """Write what each verl key of this launch became to ``RUN_DIR/verl-keys.txt`` (a
    ``--resume`` appends its own), and print the first ``NOTES_SHOWN`` of them."""
    path = resolved.run_dir / VERL_KEYS
    path.parent.mkdir(parents=True, exist_ok=True)
    notes = resolved.verl_notes
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    header = (f"# {'--resume' if resumed else 'launch'} at {stamp}: {len(notes)} verl key(s) "
              "translated or without effect (configs/verl-keys.md says what each becomes)\n")
    with path.open("a" if resumed else "w", encoding="utf-8") as out:
        out.write(header + "".join(f"{note}\n" for note in notes))
    if notes:
        print(f"relay launch: {len(notes)} verl key(s) translated (all in {path}):", flush=True)
        for note in notes[:NOTES_SHOWN]:
            print(f"  {note}", flush=True)
        if len(notes) > NOTES_SHOWN:
            print(f"  ... and {len(notes) - NOTES_SHOWN} more", flush=True)
    return path


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
