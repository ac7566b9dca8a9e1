"""Resolve what a launch would do: both configs checked, the run directory, the process plan.

``resolve_launch`` refuses a bad topology, run config or override before anything starts;
``resolve_resume`` does the same for ``--resume RUN_DIR`` from the configs stored in that run
directory; ``dry_run_report`` prints the result for ``tools/launch-cluster.py --dry-run``.

Resuming is decided here, once, for every process of the run: ``trainer.resume_mode =
"auto"`` becomes ``"resume_path"`` with the newest checkpoint of the checkpoint dir that can
be resumed (``relay.learner.checkpoint.resumable_checkpoint``: newer ones are skipped with a
warning saying why), or ``"disable"`` when there is none; a checkpoint to resume from must
be complete, this user's and not writable by others, intact by its checksums, hold the
buffer's state and the trained parts of this run's algorithm, or the launch is refused
naming it (or the file that differs). A run that would write a checkpoint over another
run's (another lineage's ``step-<N>`` in a shared checkpoint dir) is refused too, and so is
a resume under a config that changes what the buffer's saved state means
(``relay.buffer.fingerprint``), naming each key, unless ``trainer.resume_allow_changes`` lists it.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

import msgspec
from transformers import AutoConfig

from relay.algorithms.rewards.registry import UnknownDataSourceError, check_data_sources
from relay.buffer.fingerprint import buffer_fingerprint, changes
from relay.buffer.main import training_prompts
from relay.buffer.prompt_source import BufferCheckpointError, read_buffer_checkpoint
from relay.configs.checks import (
    check_cluster_request,
    check_reward_servers,
    load_run_config,
    load_topology,
)
from relay.configs.gpu_placement import check_gpu_placement, topology_claims
from relay.configs.loader import COMMAND_LINE, ConfigError, KeyPath, blame_command_line, to_toml
from relay.configs.prompt_data import DatasetError, PromptDataset, load_prompt_rows, rows_remembered
from relay.configs.run_schema import BUILTIN_MODEL_PREFIX, RunConfig
from relay.configs.rundir import (
    RESOLVED_RUN,
    RESOLVED_TOPOLOGY,
    VERL_KEYS,
    checkpoint_dir,
    is_run_dir,
)
from relay.configs.topology_schema import Topology
from relay.configs.verl_keys import ROLLOUT_NAME, Placement
from relay.generators.build import missing_engine
from relay.generators.tool_loop import configured_workflow
from relay.generators.tools import ToolConfigError
from relay.generators.vllm_engine import filters_refused
from relay.generators.workflow import WorkflowError
from relay.import_verl import is_verl_checkpoint
from relay.launcher.plan import ProcessSpec, build_plan, new_run_dir
from relay.launcher.resources import check_local, demands, learner_nodes
from relay.learner.checkpoint import CheckpointError, check_resumable, resumable_checkpoint
from relay.learner.checkpoint_lineage import continued_lineage, overwritten_checkpoints, saves_at
from relay.learner.checkpoint_meta import read_meta
from relay.learner.ulysses import KEY, check_heads
from relay.transport.endpoints import is_loopback


class ResolvedLaunch(msgspec.Struct, kw_only=True, frozen=True):
    """Everything a launch needs, already validated."""

    topology_file: str
    run_file: str
    topology: Topology
    run: RunConfig
    run_dir: Path
    processes: list[ProcessSpec]
    verl_notes: list[str] = msgspec.field(default_factory=list)  # verl keys translated


def resolve_launch(topology_file: str, run_file: str, topology_overrides: Sequence[str] = (),
                   run_overrides: Sequence[str] = ()) -> ResolvedLaunch:
    """Load and check both configs with their overrides; plan the processes. verl's
    placement keys in the run config (``trainer.n_gpus_per_node``...) apply to the topology
    after its own overrides (``relay.configs.verl_keys``)."""
    with rows_remembered():  # the training files are read once (check_prompt_files)
        topology, run, notes = load_checked(topology_file, run_file, topology_overrides,
                                            run_overrides)
        run_dir = new_run_dir(run)
        run = resolve_resume_mode(run, run_dir, run_file)
    return ResolvedLaunch(topology_file=topology_file, run_file=run_file, topology=topology,
                          run=run, run_dir=run_dir,
                          processes=planned(topology, run, run_dir), verl_notes=notes)


def resolve_resume(run_dir: str | Path, topology_overrides: Sequence[str] = (),
                   run_overrides: Sequence[str] = ()) -> ResolvedLaunch:
    """``--resume RUN_DIR``: the run directory's resolved configs, with overrides, resuming
    from its newest complete checkpoint (``trainer.resume_mode = "auto"``), or from the one
    the overrides name (``trainer.resume_mode=resume_path trainer.resume_from_path=...``)."""
    run_dir = Path(run_dir).resolve()
    if not is_run_dir(run_dir):
        raise ConfigError(str(run_dir), "", f"not a run directory: --resume needs the folder "
                                            f"a launch wrote ({RESOLVED_RUN} and "
                                            f"{RESOLVED_TOPOLOGY} beside logs/)")
    topology_file, run_file = str(run_dir / RESOLVED_TOPOLOGY), str(run_dir / RESOLVED_RUN)
    with rows_remembered():  # the training files are read once (check_prompt_files)
        return _resume_checked(run_dir, topology_file, run_file, topology_overrides,
                               run_overrides)


def _resume_checked(run_dir: Path, topology_file: str, run_file: str,
                    topology_overrides: Sequence[str],
                    run_overrides: Sequence[str]) -> ResolvedLaunch:
    """``resolve_resume`` once the run directory is known to be one."""
    topology, run, notes = load_checked(topology_file, run_file, topology_overrides,
                                        run_overrides, placed=True)
    if not overridden(run_overrides, "trainer.resume_mode", "trainer.resume_from_path"):
        auto = msgspec.structs.replace(run.trainer, resume_mode="auto", resume_from_path="")
        run = msgspec.structs.replace(run, trainer=auto)
    if not overridden(run_overrides, "trainer.resume_allow_changes"):
        # an allowance is for the launch that names it, not for every later --resume
        run = msgspec.structs.replace(run, trainer=msgspec.structs.replace(
            run.trainer, resume_allow_changes=[]))
    if run.trainer.resume_mode == "disable":
        raise ConfigError(COMMAND_LINE, "trainer.resume_mode",
                          "'disable' with --resume would start the run afresh; drop it")
    run = resolve_resume_mode(run, run_dir, run_file)
    if run.trainer.resume_mode != "resume_path":
        raise ConfigError(str(run_dir), "", f"no complete checkpoint in "
                                            f"{checkpoint_dir(run, run_dir)} to resume from "
                                            "(they are written every trainer.save_freq steps)")
    return ResolvedLaunch(topology_file=topology_file, run_file=run_file, topology=topology,
                          run=run, run_dir=run_dir, processes=planned(topology, run, run_dir),
                          verl_notes=notes)


def overridden(run_overrides: Sequence[str], *keys: str) -> bool:
    """Whether ``run_overrides`` (``key=value``, Hydra's ``+key=value`` too) set one of ``keys``."""
    return any(o.split("=", 1)[0].strip().lstrip("+") in keys for o in run_overrides)


def load_checked(topology_file: str, run_file: str, topology_overrides: Sequence[str],
                 run_overrides: Sequence[str],
                 placed: bool = False) -> tuple[Topology, RunConfig, list[str]]:
    """Both configs loaded and checked, with the run config's verl placement keys applied to
    the topology; and a line per verl key translated (``ResolvedLaunch.verl_notes``).

    A launch on this machine (``launcher.backend = "local"``) must fit it
    (``relay.launcher.resources.check_local``). A topology for Ray or Slurm names no nodes
    or GPUs (``relay.configs.checks.check_cluster_request``), unless it is ``placed``: a
    run directory's, whose backend placed it at its launch (``--resume``)."""
    placement: list[Placement] = []
    notes: list[str] = []
    run_keys: set[KeyPath] = set()
    topology_keys: set[KeyPath] = set()
    run = load_run_config(run_file, run_overrides, placement, notes, epoch_rows, run_keys)
    topology = load_topology(topology_file, topology_overrides, placement, topology_keys)
    try:
        check_prompt_files(run, run_file, "data.train_files", run.data.train_files)
        if run.evaluates:  # the evaluator, not essential, would fail after the launch
            check_prompt_files(run, run_file, "data.val_files", run.data.val_files)
        check_gpu_placement(topology_claims(topology, run.evaluates), topology_file)
        if not placed:
            check_cluster_request(topology, topology_file)
        if topology.launcher.backend == "local":
            check_local(demands(topology, run), topology_file)
        check_sequence_parallel(topology, run, run_file)
        check_fsdp_sizes(topology, run, run_file)
        check_reward_servers(topology, run, run_file)
        check_local_engines(topology, run, topology_file, placement)
        check_local_judge_engine(topology, run, run_file)
        check_engine_sampling(topology, run, run_file)
        check_rollout_workflow(run, run_file)
    except ConfigError as exc:
        blamed = blame_command_line(blame_command_line(exc, run_file, run_keys),
                                    topology_file, topology_keys)
        if blamed is exc:
            raise
        raise blamed from exc.__cause__
    return topology, run, notes


def resolve_resume_mode(run: RunConfig, run_dir: Path, source: str) -> RunConfig:
    """``run`` with ``trainer.resume_mode`` decided (module docstring)."""
    trainer = run.trainer
    folder = checkpoint_dir(run, run_dir)
    checkpoint = None
    if trainer.resume_mode == "resume_path":
        checkpoint = Path(trainer.resume_from_path)
        if is_verl_checkpoint(checkpoint):
            raise ConfigError(source, "trainer.resume_from_path", (
                f"{checkpoint} is a verl checkpoint, and Relay resumes its own (a step-<N> "
                "folder of a Relay run). Bring it in with `relay import-verl --optimizer "
                f"{checkpoint} OUT`, then start a run with model.path=OUT and "
                "actor.optim.state_path=OUT/optimizer (its weights and AdamW state)"))
        try:
            check_resumable(checkpoint, run)
        except (CheckpointError, BufferCheckpointError) as exc:
            raise ConfigError(source, "trainer.resume_from_path", str(exc)) from exc
    elif trainer.resume_mode == "auto":
        checkpoint = resumable_checkpoint(folder, run)  # checked; logs what it skips, and why
    check_overwrites(run, folder, checkpoint, source)
    if checkpoint is None:
        return msgspec.structs.replace(run, trainer=msgspec.structs.replace(
            trainer, resume_mode="disable"))
    check_fingerprint(run, checkpoint, source)
    return msgspec.structs.replace(run, trainer=msgspec.structs.replace(
        trainer, resume_mode="resume_path", resume_from_path=str(checkpoint)))


def check_fingerprint(run: RunConfig, checkpoint: Path, source: str) -> None:
    """Refuse to resume from ``checkpoint`` under a config that changes a key of the buffer
    state's fingerprint (``relay.buffer.fingerprint``) that ``trainer.resume_allow_changes`` does
    not list: the buffer would wait for a batch its lease gate never admits, or mix other
    rows under the ids of prompts already trained on. A checkpoint written before
    fingerprints has none to compare (the buffer then names what it cannot resume)."""
    saved = read_buffer_checkpoint(checkpoint).fingerprint
    if not saved:
        return
    served = msgspec.structs.replace(run, model=msgspec.structs.replace(
        run.model, path=served_model_path(run)))
    now = buffer_fingerprint(served, launch_prompts(run))
    allowed = run.trainer.allowed_resume_changes
    refused = [change for change in changes(saved, now) if change.key not in allowed]
    if not refused:
        return
    keys = [change.key for change in refused]
    allow = keys[0] if len(keys) == 1 else "'[" + ", ".join(f'"{k}"' for k in keys) + "]'"
    rows = (" (data.train_files: the rows as loaded, after data.prompt_key and "
            "data.filter_overlong_prompts)") if "data.train_files" in keys else ""
    raise ConfigError(source, ", ".join(keys), (
        f"resuming from {checkpoint} under a config that changes what the buffer's saved "
        f"state means: {'; '.join(map(str, refused))}{rows}. Resume with the checkpoint's "
        "values, start afresh (trainer.resume_mode=disable), or allow the change: "
        f"trainer.resume_allow_changes={allow} (tools/relay/README.md, "
        "Resuming a run: what a resume may change)"))


def check_overwrites(run: RunConfig, folder: Path, checkpoint: Path | None,
                     source: str) -> None:
    """Refuse a run, resuming from ``checkpoint`` (None: a fresh start; checked already),
    that would save a checkpoint where another run's lies in ``folder``: the learner never
    writes over one (``relay.learner.checkpoint_lineage``), so it would die at that save."""
    trainer = run.trainer
    first = read_meta(checkpoint).loop.step + 1 if checkpoint else 1
    last = trainer.total_training_steps or 0
    steps = [s for s in range(first, last + 1) if saves_at(s, trainer.save_freq, last)]
    if not steps:
        return
    clashes = overwritten_checkpoints(folder, continued_lineage(folder, checkpoint), steps)
    if clashes:
        raise ConfigError(source, "checkpoint.dir", (
            f"{folder} holds checkpoints of other runs where this run would save one "
            f"(trainer.save_freq={trainer.save_freq}, steps {first} to {last}): "
            + "; ".join(f"{path.name} ({whose})" for path, whose in clashes)
            + ". Relay never removes another run's checkpoints: give this run a "
              "checkpoint.dir of its own, or move those folders away"))


def served_model_path(run: RunConfig) -> str:
    """``model.path`` as the run's processes get it, the buffer's fingerprint among them: a
    ``builtin:`` model's cache folder, where the launcher builds it and points the config
    (``relay.launcher.supervisor.builtin_model``)."""
    if not run.model.path.startswith(BUILTIN_MODEL_PREFIX):
        return run.model.path
    from relay.learner.tiny_model.build import default_model_dir

    return str(default_model_dir(run.model.path.removeprefix(BUILTIN_MODEL_PREFIX)))


def epoch_rows(run: RunConfig) -> int:
    """The training rows an epoch passes over, counted as verl counts them: those
    ``data.filter_overlong_prompts`` keeps (``relay.configs.checks.training_steps``). The launcher
    tokenizes the training prompts for it, as the buffer does again when it loads them
    (``relay.buffer.main.training_prompts``); a ``builtin:`` model's tokenizer is built here, the
    same on every build, since the model itself is built only at launch."""
    return len(launch_prompts(run))


def launch_prompts(run: RunConfig) -> PromptDataset:
    """The training rows as the buffer will load them (``epoch_rows``)."""
    tokenizer = None
    if run.model.path.startswith(BUILTIN_MODEL_PREFIX):
        from relay.learner.tiny_model.tokenizer import builtin_tokenizer

        tokenizer = builtin_tokenizer(run.model.path.removeprefix(BUILTIN_MODEL_PREFIX))
    return training_prompts(run, tokenizer)


def check_prompt_files(run: RunConfig, source: str, key: str, files: Sequence[str]) -> None:
    """The rows of ``files`` (``key``: ``data.train_files`` or ``data.val_files``) load in
    verl's schema (``relay.configs.prompt_data``: suffix, rows, fields) and each ``data_source``
    has a reward function (or ``custom_reward_function.path`` gives one): refused here, not
    by the buffer or the evaluator after the launch. Each file is read once per launch
    (``resolve_launch`` reads them inside ``rows_remembered``: the epoch count and the
    fingerprint reuse the rows), so the cost is one parse of the files in the launcher, as
    the buffer's own at its start, and the rows are dropped once the launch is resolved."""
    try:
        rows = load_prompt_rows(files, prompt_key=run.data.prompt_key)
        if not run.custom_reward_function.path:
            check_data_sources({row.data_source for row in rows})
    except (DatasetError, UnknownDataSourceError) as exc:
        raise ConfigError(source, key, str(exc)) from exc


def check_sequence_parallel(topology: Topology, run: RunConfig, source: str) -> None:
    """``actor.ulysses_sequence_parallel_size`` divides the learner's ranks, and fits the
    attention heads of every model the learner loads (``RunConfig.learner_model_paths``)
    that is already on disk (a ``builtin:`` model is built later: the learner checks it)."""
    size = run.actor.ulysses_sequence_parallel_size
    if size == 1:
        return
    ranks = learner_nodes(topology.learner) * topology.learner.nproc_per_node
    if ranks % size:
        raise ConfigError(source, KEY, f"{size} does not divide the learner's {ranks} ranks "
                                       "(topology learner: nnodes, or len(hosts), x "
                                       "nproc_per_node)")
    for path in sorted(p for p in run.learner_model_paths if (Path(p) / "config.json").is_file()):
        try:
            check_heads(AutoConfig.from_pretrained(
                path, trust_remote_code=run.model.trust_remote_code), size)
        except ValueError as exc:
            raise ConfigError(source, KEY, f"{exc} ({path})") from None


def check_fsdp_sizes(topology: Topology, run: RunConfig, source: str) -> None:
    """verl's ``fsdp_size`` of the policy, the reference (when set apart from the policy's)
    and the critic (with ``gae``) is -1 or divides the learner's ranks
    (``relay.learner.model.sharding_mesh``, which the learner applies): refused here, before
    anything starts, rather than by every rank after the launch."""
    ranks = learner_nodes(topology.learner) * topology.learner.nproc_per_node
    sizes = {"actor.fsdp_config.fsdp_size": run.actor.fsdp_config.fsdp_size,
             "ref.fsdp_config.fsdp_size": run.ref.fsdp_config.fsdp_size}
    if run.algorithm.estimator.critic:
        sizes["critic.model.fsdp_config.fsdp_size"] = run.critic.model.fsdp_config.fsdp_size
    for key, size in sizes.items():
        if size is not None and size not in (-1, ranks) and ranks % size:
            raise ConfigError(source, key, f"{size} must be -1 (shard over every rank) or "
                                           f"divide the learner's {ranks} ranks (topology "
                                           "learner: nnodes, or len(hosts), x nproc_per_node)")


def check_local_engines(topology: Topology, run: RunConfig, source: str,
                        placement: Sequence[Placement] = ()) -> None:
    """Every engine of a process placed on this machine (a loopback host) can start here:
    an engine whose package is missing (vllm, sglang) is refused before anything starts,
    not found by a generator that dies after the launch. Remote hosts have environments of
    their own: their generators report it themselves. An engine that verl's
    ``rollout.name`` in ``placement`` chose is refused naming that key, where it is fixed."""
    placed = [(f"generators[{i}].engine", g.engine, g.host)
              for i, g in enumerate(topology.generators)]
    if run.evaluates:
        placed.append(("evaluator.engine", topology.evaluator.engine, topology.evaluator.host))
    chosen = [item for item in placement if item.key == ROLLOUT_NAME][-1:]
    for key, engine, host in placed:
        problem = missing_engine(engine) if is_loopback(host) else None
        if problem and chosen and chosen[0].value == engine:
            raise ConfigError(chosen[0].source, chosen[0].key,
                              f"{problem} Here the run config's {ROLLOUT_NAME} chose it for "
                              f"every generator and the evaluator: give another engine there "
                              f"(e.g. {ROLLOUT_NAME}=lean, Relay's own).")
        if problem:
            raise ConfigError(source, key, problem)


def check_local_judge_engine(topology: Topology, run: RunConfig, source: str) -> None:
    """The judge's engine (``reward_model.judge.engine``) can start where it runs on this
    machine: in each reward server (``[[reward_models]]``) or, without them, in each
    generator; refused naming the run config's key before anything starts."""
    judge = run.reward_model.judge
    if not judge.enable or judge.url:
        return
    hosts = [r.host for r in topology.reward_models] or [g.host for g in topology.generators]
    problem = missing_engine(judge.engine) if any(is_loopback(h) for h in hosts) else None
    if problem:
        raise ConfigError(source, "reward_model.judge.engine", problem)


def check_engine_sampling(topology: Topology, run: RunConfig, source: str) -> None:
    """A vLLM generator (or evaluator) asked for top-p or top-k sampling is refused before
    anything starts, naming the run config's key: vLLM cannot report the temperature-only
    behavior log-prob under them (``relay.generators.vllm_engine.filters_refused``)."""
    uses = [(run.rollout.top_p, run.rollout.top_k, "rollout")
            for g in topology.generators if g.engine == "vllm"]
    val = run.rollout.val_kwargs
    if run.evaluates and topology.evaluator.engine == "vllm" and val.sampling_temperature > 0:
        uses.append((val.top_p, val.top_k, "rollout.val_kwargs"))
    for top_p, top_k, section in uses:
        problem = filters_refused(top_p, top_k, section)
        if problem:
            key = f"{section}.top_p" if top_p < 1.0 else f"{section}.top_k"
            raise ConfigError(source, key, problem)


def check_rollout_workflow(run: RunConfig, source: str) -> None:
    """``rollout.workflow`` or the multi-turn tool loop loaded as the generators will load
    them (the tool and interaction YAML built, a verl class's Relay stand-in noted), so that
    a bad one is refused before anything starts, naming the key."""
    rollout = run.rollout
    if not (rollout.workflow or rollout.multi_turn.enable):
        return
    try:
        configured_workflow(rollout)
    except (WorkflowError, ToolConfigError, OSError) as exc:
        interaction = rollout.multi_turn.interaction_config_path
        key = ("rollout.workflow" if rollout.workflow
               else "rollout.multi_turn.interaction_config_path"
               if interaction and str(exc).startswith(interaction)
               else "rollout.multi_turn.tool_config_path")
        raise ConfigError(source, key, str(exc)) from exc


def planned(topology: Topology, run: RunConfig, run_dir: Path) -> list[ProcessSpec]:
    """The plan as ``--dry-run`` shows it: under Ray one process per learner rank, as the
    Ray backend starts them (``relay.launcher.ray_backend``), its hosts Ray's choice."""
    return build_plan(topology, run, run_dir, learner_ranks=topology.launcher.backend == "ray")


def reservations(topology: Topology, run: RunConfig) -> list[str]:
    """What each process reserves of a node under Ray or Slurm, which choose the hosts."""
    if topology.launcher.backend not in ("ray", "slurm"):
        return []
    lines = [f"# Hosts and ports: chosen at launch by {topology.launcher.backend.title()}; "
             "each process reserves (relay.launcher.resources):"]
    for demand in demands(topology, run):
        extra = "".join(f", {amount:g} {name}" for name, amount in demand.resources.items())
        memory = f", {demand.memory_gib:g} GiB" if demand.memory_gib else ""
        lines.append(f"#   {demand.name}: {demand.cpus:g} CPU(s), {demand.gpus} GPU(s)"
                     f"{memory}{extra}")
    return lines


def dry_run_report(resolved: ResolvedLaunch) -> str:
    """The resolved configs as TOML and the processes that would start, for a person."""
    topology_toml = to_toml(resolved.topology).decode()
    run_toml = to_toml(resolved.run).decode()
    ssh = resolved.topology.launcher.ssh
    workdir = resolved.topology.launcher.remote_workdir
    lines = [
        f"# Resolved topology (from {resolved.topology_file})",
        topology_toml,
        f"# Resolved run config (from {resolved.run_file})",
        run_toml,
        f"# verl keys ({len(resolved.verl_notes)}; a launch writes them to "
        f"{resolved.run_dir / VERL_KEYS}; configs/verl-keys.md):",
        *(f"#   {note}" for note in resolved.verl_notes),
        f"# Run directory: {resolved.run_dir}",
        f"# Resuming from: {resolved.run.trainer.resume_from_path or 'nothing (a fresh start)'}",
        *reservations(resolved.topology, resolved.run),
        f"# Processes ({len(resolved.processes)}):",
    ]
    width = max(len(p.name) for p in resolved.processes)
    backend = resolved.topology.launcher.backend
    placed_by = f"({backend}'s)" if backend in ("ray", "slurm") else ""  # hosts chosen later
    for proc in resolved.processes:
        kind = "essential" if proc.essential else "optional"
        command = shlex.join(proc.command_line(ssh, workdir))
        if proc.local and proc.env:  # a remote one's is on its ssh command line
            command = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(proc.env.items())) \
                + f" {command}"
        host = placed_by or proc.host
        lines.append(f"  {proc.name:<{width}}  {proc.role:<12} {host:<15} {kind:<9} {command}")
    return "\n".join(lines)
