"""Load a topology or a run config and check what the schema alone cannot.

The schema checks types and ranges key by key; this module checks what spans keys or
touches the disk: data files exist, the model path holds a checkpoint, generator names are
unique, a non-loopback address has CURVE keys, the topology asks of its launcher backend
what that backend does. Each failure is a ``ConfigError`` naming the file and the key.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import msgspec
import pyarrow.parquet as pq

from relay.algorithms.registry import advantage_estimator, check_protocol, policy_loss_mode
from relay.algorithms.rewards.config import OWN_ARGUMENTS
from relay.algorithms.user_code import is_spec
from relay.configs.gpu_placement import check_process_gpus
from relay.configs.hub import looks_like_hub_id, resolve_hub_id
from relay.configs.loader import ConfigError, KeyPath, blame_command_line, load, read_toml
from relay.configs.run_schema import (
    BUILTIN_MODEL_PREFIX,
    IMPORTED_OPTIMIZER_STATE,
    VERL_ALIASES,
    RunConfig,
)
from relay.configs.topology_schema import LearnerPlacement, Topology
from relay.configs.verl_keys import Placement, VerlKeys, apply_placement
from relay.transport.endpoints import is_loopback

BUILTIN_MODELS = ("tiny-arith", "tiny-arith-tools")
DEFAULT_TOPOLOGY_FILE = Path(__file__).resolve().parent / "topology.toml"
MODEL_PATH_KEYS = (("model", "path"), ("critic", "model", "path"),
                   ("reward_model", "model", "path"))
"""The run config's model paths: each a local folder, a ``builtin:`` model or a Hub ID."""
DEVICES = "'cpu', 'cuda' or 'cuda:N' (N: a GPU index)"
DEVICE = re.compile(r"cpu|cuda(:\d+)?")
DEFAULT_TRAINING_STEPS = 100  # neither trainer.total_training_steps nor total_epochs set
CLUSTER_BACKENDS = ("ray", "slurm")  # they pick the nodes and GPUs themselves
EpochRows = Callable[[RunConfig], int]
"""The training rows an epoch passes over once ``data.filter_overlong_prompts`` dropped the
long ones: their count needs the model's tokenizer, which this package does not load (the
launcher's ``relay.launcher.resolve.epoch_rows`` does). A ``ValueError`` it raises (rows that do
not load, or that ``data.truncation = "error"`` refuses) is reported against
``data.train_files``."""


def load_topology(path: str | Path, overrides: Iterable[str] = (),
                  placement: Sequence[Placement] = (),
                  command_line_keys: set[KeyPath] | None = None) -> Topology:
    """Decode and check ``topology.toml`` (overrides given without the ``topology.`` prefix),
    with a run config's verl placement keys applied (``verl_keys.apply_placement``).
    ``command_line_keys`` receives the keys the overrides set (``loader.load``)."""
    keys: set[KeyPath] = set()
    try:
        topology = apply_placement(load(Topology, path, overrides,
                                        path_keys=[("security", "keys_dir"),
                                                   ("security", "sockets_dir")],
                                        command_line_keys=keys), placement)
    except ConfigError as exc:
        check_not_a_run_config(path, exc)
        raise
    if command_line_keys is not None:
        command_line_keys.update(keys)
    check_verl_ranks(topology, placement)
    try:
        check_topology(topology, str(path))
    except ConfigError as exc:
        raise blame_command_line(exc, str(path), keys) from exc.__cause__
    return topology


def check_not_a_run_config(path: str | Path, error: ConfigError) -> None:
    """A run config given where the topology goes (``relay launch my-run.toml``): a
    ``ConfigError`` naming that mistake instead of ``error`` ("data: unknown key"), when
    the file's top-level sections are a run config's."""
    if error.source != str(path):
        return
    try:
        data = read_toml(Path(path))
    except ConfigError:
        return
    run_sections = {*RunConfig.__struct_fields__, *(alias[0] for alias in VERL_ALIASES),
                    "actor_rollout_ref"} - set(Topology.__struct_fields__)
    found = sorted(set(data) & run_sections)
    if found:
        raise ConfigError(str(path), "", (
            f"this is a run config (it has {', '.join(f'[{s}]' for s in found)}), not a "
            "topology: the first config file is the topology (where the processes run) and "
            f"the run config comes second, e.g. relay launch {DEFAULT_TOPOLOGY_FILE} {path} "
            "(the embedded default topology)")) from error


def check_verl_ranks(topology: Topology, placement: Sequence[Placement]) -> None:
    """verl's ``trainer.n_gpus_per_node`` (the learner's ranks per host) agrees with the
    GPUs the topology lists for them (``learner.gpus``), refused naming the verl key."""
    gpus = topology.learner.gpus
    for item in placement:
        if item.key == "trainer.n_gpus_per_node" and gpus is not None and item.value != len(gpus):
            raise ConfigError(item.source, item.key,
                              f"{item.value} ranks per host, but the topology's learner.gpus "
                              f"lists {len(gpus)} GPU(s) ({gpus}), one per rank: make them "
                              "agree, or drop one of the two")


def check_topology(topology: Topology, source: str) -> None:
    """Devices, GPU lists, generator names, the backend's hosts (``check_backend_hosts``),
    and CURVE for any non-loopback address."""
    check_devices(topology, source)
    check_backend_hosts(topology, source)
    check_process_gpus(topology, source)
    names = [g.name for g in topology.generators]
    for i, name in enumerate(names):
        if not name:
            raise ConfigError(source, f"generators[{i}].name", "must not be empty")
        if names.index(name) != i:
            raise ConfigError(source, f"generators[{i}].name",
                              f"{name!r} is already the name of generators[{names.index(name)}]")
    check_reward_server_names(topology, source)
    hosts = {"buffer.host": topology.buffer.host, "launcher.host": topology.launcher.host,
             **process_hosts(topology)}
    security = topology.security
    if security.curve:
        keys = Path(security.keys_dir) if security.keys_dir else None
        if keys is None or not keys.is_dir():
            raise ConfigError(source, "security.keys_dir",
                              f"CURVE is on but the keys folder {security.keys_dir!r} does not "
                              "exist; create it with tools/make-curve-keys.py")
        return
    for key, host in hosts.items():
        if not is_loopback(host):
            raise ConfigError(source, key,
                              f"{host!r} is not a loopback address, and Relay never binds or "
                              "talks over a network without CURVE: set [security] curve = true "
                              "and keys_dir (see tools/make-curve-keys.py)")


PROCESS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")
"""A reward server's name: its log file and its ipc socket file (``rm-<name>``) carry it."""
RESERVED_NAMES = ("buffer", "learner", "evaluator")


def check_reward_server_names(topology: Topology, source: str) -> None:
    """Each ``[[reward_models]]`` entry has a name of its own among every process of the
    run (the plan, the logs and the Ray/Slurm placement know processes by name), usable in
    a file name (``PROCESS_NAME``)."""
    taken = {g.name: f"generators[{i}]" for i, g in enumerate(topology.generators)}
    for i, server in enumerate(topology.reward_models):
        key = f"reward_models[{i}].name"
        name = server.name
        if not PROCESS_NAME.fullmatch(name):
            raise ConfigError(source, key, f"{name!r}: give 1 to 32 letters, digits, '_', "
                                           "'.' or '-', starting with a letter or digit")
        if name in RESERVED_NAMES or name.startswith("learner"):
            raise ConfigError(source, key, f"{name!r} is the name of one of the run's own "
                                           "processes; give the reward server another")
        if name in taken:
            raise ConfigError(source, key, f"{name!r} is already the name of {taken[name]}")
        taken[name] = f"reward_models[{i}]"


def check_reward_servers(topology: Topology, run: RunConfig, source: str) -> None:
    """``[[reward_models]]`` entries have something to serve: the discriminative reward
    model (``reward_model.enable``, not PRIME's PRM, which the learner trains) or the
    judge (``reward_model.judge.enable``). Without them a judge served by vLLM in a
    generator whose own engine is vLLM is refused: two vLLM engines in one process collide
    on torch.distributed's default group, so that judge goes in a ``[[reward_models]]``
    process. ``source``: the run config, whose keys the errors name."""
    rm, judge = run.reward_model, run.reward_model.judge
    discriminative = rm.enable and not run.algorithm.estimator.prm
    if topology.reward_models and not (discriminative or judge.enable):
        why = (f" (with algorithm.adv_estimator = {run.algorithm.adv_estimator!r}, "
               "reward_model is PRIME's implicit PRM, which the learner trains and no reward "
               "server scores with)") if rm.enable else ""
        raise ConfigError(source, "reward_model.enable, reward_model.judge.enable", (
            f"the topology has {len(topology.reward_models)} [[reward_models]] process(es) "
            f"but neither reward_model.enable nor reward_model.judge.enable is on{why}: "
            "turn one on, or drop the [[reward_models]] entries"))
    if topology.reward_models or not judge.enable or judge.url or judge.engine != "vllm":
        return
    clashing = [g.name for g in topology.generators if g.engine == "vllm"]
    if clashing:
        raise ConfigError(source, "reward_model.judge.engine", (
            f"'vllm' would start a second vLLM engine inside generator {clashing[0]!r}, whose "
            "own engine is vLLM, and two vLLM engines in one process collide on "
            "torch.distributed's default group: serve the judge in a process of its own, a "
            "[[reward_models]] entry of the topology (name = \"rm0\"), or give it another "
            "engine (lean, torch, hf)"))


def process_hosts(topology: Topology) -> dict[str, str]:
    """Where each process runs, by the key that says it."""
    hosts = {"buffer.host": topology.buffer.host}
    hosts.update({f"learner.hosts[{i}]": h for i, h in enumerate(topology.learner.hosts)})
    hosts.update({f"generators[{i}].host": g.host for i, g in enumerate(topology.generators)})
    hosts.update({f"reward_models[{i}].host": r.host
                  for i, r in enumerate(topology.reward_models)})
    hosts["evaluator.host"] = topology.evaluator.host
    return hosts


def check_backend_hosts(topology: Topology, source: str) -> None:
    """The hosts fit ``launcher.backend``: ``local`` starts every process on this machine,
    so each host is a loopback address; ``local`` and ``ssh`` run the learner on
    ``learner.hosts``, so ``learner.nnodes`` (the node count Ray and Slurm pick) is 0 or
    their count; Ray's custom ``resources`` are for the Ray backend only."""
    backend = topology.launcher.backend
    if backend == "local":
        for key, host in process_hosts(topology).items():
            if not is_loopback(host):
                raise ConfigError(source, key, (
                    f"{host!r} is not this machine, and launcher.backend = 'local' starts "
                    "every process here: set launcher.backend = 'ssh' to start it there "
                    "over ssh (or 'ray' or 'slurm' under a cluster manager)"))
    learner = topology.learner
    if backend not in CLUSTER_BACKENDS and learner.nnodes not in (0, len(learner.hosts)):
        raise ConfigError(source, "learner.nnodes", (
            f"{learner.nnodes} nodes, but launcher.backend = {backend!r} runs the learner on "
            f"the {len(learner.hosts)} host(s) of learner.hosts: list the hosts there and "
            "leave learner.nnodes at 0 (Ray and Slurm pick nodes by it)"))
    for section, placed in (("buffer", topology.buffer), ("learner", topology.learner),
                            *((f"generators[{i}]", g) for i, g in enumerate(topology.generators)),
                            *((f"reward_models[{i}]", r)
                              for i, r in enumerate(topology.reward_models)),
                            ("evaluator", topology.evaluator)):
        if placed.resources and backend != "ray":
            raise ConfigError(source, f"{section}.resources", (
                f"{placed.resources} are Ray custom resources, which only launcher.backend "
                f"= 'ray' reserves, not {backend!r}: drop them, or launch on Ray"))


def check_cluster_request(topology: Topology, source: str) -> None:
    """Under Ray and Slurm (``CLUSTER_BACKENDS``) the backend picks each process's node and
    GPUs, so a topology to launch there names none: no ``gpus`` lists (the backend sets
    ``CUDA_VISIBLE_DEVICES``), a learner device that is ``cpu`` or ``cuda`` (its GPUs are
    reserved before it starts, so ``auto`` cannot decide), and the learner's nodes counted
    by ``learner.nnodes``, not listed in ``learner.hosts``. Checked on the topology a
    launch is asked for, before a backend placed it (``relay.launcher.resolve``)."""
    backend = topology.launcher.backend
    if backend not in CLUSTER_BACKENDS:
        return
    learner = topology.learner
    default_hosts = LearnerPlacement().hosts
    if learner.hosts != default_hosts:
        raise ConfigError(source, "learner.hosts", (
            f"{learner.hosts}: launcher.backend = {backend!r} picks the learner's nodes "
            f"itself; drop learner.hosts and set learner.nnodes = {len(learner.hosts)} "
            "(the number of nodes, each of learner.nproc_per_node ranks)"))
    if learner.device == "auto":
        raise ConfigError(source, "learner.device", (
            f"'auto' under launcher.backend = {backend!r}, which reserves the learner's GPUs "
            "before it starts: say 'cuda' (one GPU per rank) or 'cpu'"))
    listed = [("learner", learner.gpus),
              *((f"generators[{i}]", g.gpus) for i, g in enumerate(topology.generators)),
              *((f"reward_models[{i}]", r.gpus) for i, r in enumerate(topology.reward_models)),
              ("evaluator", topology.evaluator.gpus)]
    for section, gpus in listed:
        if gpus is not None:
            raise ConfigError(source, f"{section}.gpus", (
                f"{gpus}: launcher.backend = {backend!r} assigns each process its GPUs "
                "(CUDA_VISIBLE_DEVICES); drop the list and set the device to 'cuda' (vLLM "
                "and SGLang take tensor_model_parallel_size GPUs, the rest one)"))


def check_devices(topology: Topology, source: str) -> None:
    """Each generator's, reward server's and the evaluator's ``device`` is one torch can
    place an engine on: ``DEVICES`` (the learner's is a choice of the schema: cpu, cuda,
    auto)."""
    placed = [(f"generators[{i}].device", g.device) for i, g in enumerate(topology.generators)]
    placed += [(f"reward_models[{i}].device", r.device)
               for i, r in enumerate(topology.reward_models)]
    placed.append(("evaluator.device", topology.evaluator.device))
    for key, device in placed:
        if DEVICE.fullmatch(device) is None:
            raise ConfigError(source, key, f"{device!r} is not a device: give {DEVICES}")


def load_run_config(path: str | Path, overrides: Iterable[str] = (),
                    placement: list[Placement] | None = None,
                    notes: list[str] | None = None,
                    epoch_rows: EpochRows | None = None,
                    command_line_keys: set[KeyPath] | None = None) -> RunConfig:
    """Decode and check a run config; relative paths resolve against its folder.

    ``trainer.total_epochs`` on the command line (without ``trainer.total_training_steps``)
    sets the length even where the file sets ``trainer.total_training_steps``.
    verl's keys are accepted as ``relay.configs.verl_keys`` says; its placement keys
    (``trainer.n_gpus_per_node``...) are appended to ``placement`` for the caller to apply to
    the topology (``verl_keys.apply_placement``), or refused when it is None. ``notes``
    receives one line per verl key translated or without effect. ``epoch_rows`` counts an
    epoch's rows after ``data.filter_overlong_prompts`` (``training_steps``).
    ``command_line_keys`` receives the keys the overrides set (``loader.load``); a check
    failing on one of them names the command line, not the file."""
    verl = VerlKeys(placement)
    overrides = list(overrides)
    keys = {o.partition("=")[0].strip().lstrip("+") for o in overrides}
    if "trainer.total_epochs" in keys and "trainer.total_training_steps" not in keys:
        # the command line beats the file: its epochs replace the file's step count
        overrides.insert(0, "trainer.total_training_steps=null")
    keys: set[KeyPath] = set()
    run = load(
        RunConfig,
        path,
        overrides,
        path_keys=[("data", "train_files"), ("data", "val_files"), *MODEL_PATH_KEYS,
                   ("model", "lora_adapter_path"), ("actor", "optim", "state_path"),
                   ("critic", "optim", "state_path"),
                   ("checkpoint", "dir"), ("trainer", "resume_from_path"),
                   ("trainer", "validation_data_dir"), ("trainer", "rollout_data_dir"),
                   ("rollout", "multi_turn", "tool_config_path"),
                   ("rollout", "multi_turn", "interaction_config_path")],
        file_or_module_keys=[("custom_reward_function", "path")],
        function_keys=[("algorithm", "adv_estimator"), ("actor", "policy_loss", "loss_mode"),
                       ("rollout", "workflow")],
        aliases=VERL_ALIASES,
        foreign=verl,
        hub_id_keys=MODEL_PATH_KEYS,
        command_line_keys=keys,
    )
    if notes is not None:
        notes.extend(verl.notes)
    if command_line_keys is not None:
        command_line_keys.update(keys)
    try:
        return check_run_config(run, str(path), epoch_rows)
    except ConfigError as exc:
        raise blame_command_line(exc, str(path), keys) from exc.__cause__


def _as_list(files: str | list[str]) -> list[str]:
    return [files] if isinstance(files, str) else list(files)


def check_run_config(run: RunConfig, source: str,
                     epoch_rows: EpochRows | None = None) -> RunConfig:
    """Cross-key and on-disk checks; returns the config with file lists normalized and the
    run's length in steps resolved (``training_steps``)."""
    data = msgspec.structs.replace(run.data, train_files=_as_list(run.data.train_files),
                                   val_files=_as_list(run.data.val_files))
    if not data.train_files:
        raise ConfigError(source, "data.train_files", "needs at least one file")
    for key in ("train_files", "val_files"):
        for i, file in enumerate(getattr(data, key)):
            if not Path(file).is_file():
                raise ConfigError(source, f"data.{key}[{i}]", f"file not found: {file}")
    check_algorithm_entries(run, source)
    run = resolve_model_paths(run, source)
    model_path = run.model.path
    for key, path in (("critic.model.path", run.critic.model.path),
                      ("reward_model.model.path", run.reward_model.model.path)):
        if key.startswith("reward_model") and run.reward_model.model.input_tokenizer:
            continue  # the chat is re-rendered in the reward model's own tokens
        builtin = any(p.startswith(BUILTIN_MODEL_PREFIX) for p in (path, model_path))
        if path and not builtin:  # a builtin: model is built at launch, not read here
            check_same_vocabulary(source, key, path, model_path)
    check_replay_filters(run, source)
    mini = run.actor.ppo_mini_batch_size
    if mini and data.train_batch_size % mini:
        raise ConfigError(source, "actor.ppo_mini_batch_size",
                          f"{mini} does not divide data.train_batch_size "
                          f"({data.train_batch_size})")
    estimator = run.algorithm.estimator
    if estimator.group and run.rollout.n < 2:
        raise ConfigError(source, "rollout.n",
                          f"{estimator.name} compares the samples of a prompt with each other "
                          f"and needs at least 2 per prompt, got {run.rollout.n}")
    per_prompt = estimator.samples_per_prompt(run.rollout.n)
    if run.rollout.max_num_seqs < per_prompt:
        raise ConfigError(source, "rollout.max_num_seqs",
                          f"{run.rollout.max_num_seqs} cannot hold one prompt's {per_prompt} "
                          "sequences (rollout.n, and the greedy baseline with remax)")
    check_algorithm_combinations(run, source)
    check_algorithm_sections(run, source)
    check_resume(run, source)
    check_timeouts(run, source)
    check_lora(run, source)
    check_strategy(run, source)
    check_imported_optimizers(run, source)
    if run.trainer.rollout_data_dir and (
            problem := dump_dir_problem(Path(run.trainer.rollout_data_dir))):
        raise ConfigError(source, "trainer.rollout_data_dir", problem)
    optim = run.actor.optim
    if optim.betas[0] >= 1 or optim.betas[1] >= 1 or min(optim.betas) < 0:
        raise ConfigError(source, "actor.optim.betas", f"each beta must be in [0, 1), "
                                                        f"got {optim.betas}")
    for name in run.tracking.loggers:
        if name not in ("console", "mlflow") and importlib.util.find_spec(name) is None:
            raise ConfigError(source, "tracking.loggers",
                              f"{name!r} needs the {name} package, which is not installed "
                              f"(pip install {name}), or drop it from the list")
    ref_sp = run.ref.ulysses_sequence_parallel_size
    if ref_sp is not None and ref_sp != run.actor.ulysses_sequence_parallel_size:
        raise ConfigError(source, "ref.ulysses_sequence_parallel_size",
                          f"{ref_sp} differs from actor.ulysses_sequence_parallel_size "
                          f"({run.actor.ulysses_sequence_parallel_size}): every model of the "
                          "learner runs on one sequence-parallel mesh; set the actor's size "
                          "(it applies to the reference too) and drop this key")
    steps = training_steps(msgspec.structs.replace(run, data=data), source, epoch_rows)
    trainer = msgspec.structs.replace(run.trainer, total_training_steps=steps)
    return msgspec.structs.replace(run, data=data, trainer=trainer)


def resolve_model_paths(run: RunConfig, source: str) -> RunConfig:
    """``run`` with each model path (``MODEL_PATH_KEYS``) checked: a ``builtin:`` model
    Relay knows (built at launch), a local Hugging Face checkpoint, or a Hub ID, replaced
    by its local snapshot folder (``relay.configs.hub.resolve_hub_id``: the cache, else a
    download)."""
    for parts in MODEL_PATH_KEYS:
        key = ".".join(parts)
        path = model_path_at(run, parts)
        if not path:
            continue
        if path.startswith(BUILTIN_MODEL_PREFIX):
            name = path.removeprefix(BUILTIN_MODEL_PREFIX)
            if name not in BUILTIN_MODELS:
                raise ConfigError(source, key, f"unknown built-in model {name!r}; "
                                               f"known: {', '.join(BUILTIN_MODELS)}")
            continue
        if (Path(path) / "config.json").is_file():
            continue
        if not looks_like_hub_id(path):
            raise ConfigError(source, key,
                              f"no Hugging Face checkpoint at {path} (config.json missing); "
                              "give a local folder saved with save_pretrained, a Hub ID "
                              "(ORG/NAME) or a builtin: model")
        try:
            local = resolve_hub_id(path)
        except ValueError as exc:
            raise ConfigError(source, key, str(exc)) from exc
        if not (Path(local) / "config.json").is_file():
            raise ConfigError(source, key, f"the Hub model {path} (in {local}) has no "
                                           "config.json: not a transformers checkpoint")
        run = replace_model_path(run, parts, local)
    return run


def model_path_at(run: RunConfig, parts: Sequence[str]) -> str:
    """The model path at ``parts``, one of ``MODEL_PATH_KEYS``."""
    node: object = run
    for part in parts:
        node = getattr(node, part)
    assert isinstance(node, str)
    return node


def replace_model_path(run: RunConfig, parts: Sequence[str], path: str) -> RunConfig:
    """``run`` with the model path at ``parts`` (one of ``MODEL_PATH_KEYS``) set to ``path``."""
    def replaced(node: msgspec.Struct, rest: Sequence[str]) -> msgspec.Struct:
        value = path if len(rest) == 1 else replaced(getattr(node, rest[0]), rest[1:])
        return msgspec.structs.replace(node, **{rest[0]: value})

    return replaced(run, parts)


def training_steps(run: RunConfig, source: str, epoch_rows: EpochRows | None = None) -> int:
    """The run's length in learner steps (``TrainerConfig``): ``total_training_steps``, else
    ``total_epochs`` passes over the rows of ``data.train_files``, else the default. As in
    verl, an epoch is the rows ``data.filter_overlong_prompts`` keeps, counted by
    ``epoch_rows``; without it such a length is refused rather than counted wrong."""
    trainer, data = run.trainer, run.data
    if trainer.total_training_steps is not None:
        return trainer.total_training_steps
    if trainer.total_epochs is None:
        return DEFAULT_TRAINING_STEPS
    if not data.filter_overlong_prompts:
        rows, what = sum(count_rows(Path(file)) for file in data.train_files), "training rows"
    elif epoch_rows is not None:
        try:
            rows = epoch_rows(run)
        except ValueError as exc:
            raise ConfigError(source, "data.train_files", str(exc)) from exc
        what = "training rows left by data.filter_overlong_prompts"
    else:
        raise ConfigError(source, "trainer.total_epochs",
                          "an epoch is the rows data.filter_overlong_prompts keeps, which only "
                          "the model's tokenizer can count, and this loader has none: launch "
                          "with tools/launch-cluster.py, or set trainer.total_training_steps")
    per_epoch = rows // data.train_batch_size
    if per_epoch == 0:
        raise ConfigError(source, "trainer.total_epochs",
                          f"an epoch of {rows} {what} makes no step of "
                          f"data.train_batch_size = {data.train_batch_size} prompts; lower the "
                          "batch size or set trainer.total_training_steps")
    return trainer.total_epochs * per_epoch


def count_rows(path: Path) -> int:
    """Rows in a prompt file: a parquet file's row count, a JSONL file's non-blank lines
    (``relay.configs.prompt_data`` validates them when the buffer loads them)."""
    if path.suffix == ".parquet":
        return pq.read_metadata(path).num_rows
    with path.open(encoding="utf-8") as lines:
        return sum(1 for line in lines if line.strip())


def dump_dir_problem(folder: Path) -> str:
    """Why ``folder`` cannot hold ``trainer.rollout_data_dir``'s dumps ("" when it can; the
    buffer writes them, ``relay.buffer.rollout_dump``): it is not a folder, or it (or, when it
    does not exist yet, its nearest existing parent, where it would be created) is not
    writable by this user."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if existing == folder and not folder.is_dir():
        return f"{folder} exists and is not a folder"
    if not existing.is_dir():
        return f"{existing} is not a folder, so {folder} cannot be created"
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is" if existing == folder else f"cannot be created: {existing} is"
        return f"{folder} {what} not writable by this user"
    return ""


def check_strategy(run: RunConfig, source: str) -> None:
    """``actor.strategy = "deepspeed"``: DeepSpeed installed, and none of the FSDP2-only
    settings (they would be ignored silently), each refusal naming its key."""
    if run.actor.strategy != "deepspeed":
        return
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(source, "actor.strategy", "\"deepspeed\" needs DeepSpeed, which is "
                          "not installed: pip install 'relay-rl[deepspeed]', or use \"fsdp2\"")
    fsdp = run.actor.fsdp_config
    for key, value, instead in (
            ("actor.fsdp_config.param_offload", fsdp.param_offload,
             "actor.deepspeed.offload_param (zero_stage = 3)"),
            ("actor.fsdp_config.optimizer_offload", fsdp.optimizer_offload,
             "actor.deepspeed.offload_optimizer"),
            ("actor.fsdp_config.fsdp_size", fsdp.fsdp_size != -1,
             "the default -1 (ZeRO partitions over every rank)"),
            ("actor.ulysses_sequence_parallel_size",
             run.actor.ulysses_sequence_parallel_size > 1, "1 (Ulysses runs on FSDP2's mesh)"),
            ("actor.use_torch_compile", run.actor.use_torch_compile, "false"),
            ("model.lora_rank", run.model.lora_rank > 0,
             "0 (LoRA adapters train under FSDP2)")):
        if value:
            raise ConfigError(source, key, f"not available with actor.strategy = "
                              f"\"deepspeed\": use {instead}, or actor.strategy = \"fsdp2\"")


def check_lora(run: RunConfig, source: str) -> None:
    """The LoRA keys (``ModelConfig``): an adapter folder only with LoRA on, and something
    to adapt; the module names themselves are checked against the model when the learner
    loads it (``relay.learner.lora.check_target_modules``)."""
    model = run.model
    if model.lora_adapter_path is not None and model.lora_rank == 0:
        raise ConfigError(source, "model.lora_adapter_path", "needs model.lora_rank > 0 (the "
                          "adapter's rank): LoRA is off at lora_rank = 0")
    if model.lora_rank > 0 and isinstance(model.target_modules, list) \
            and not model.target_modules:
        raise ConfigError(source, "model.target_modules", "is empty: name the modules to "
                          "adapt, or 'all-linear'")


def check_imported_optimizers(run: RunConfig, source: str) -> None:
    """``optim.state_path`` (``OptimConfig``): a folder ``relay import-verl --optimizer`` wrote,
    for a model that trains whole under FSDP2 (the import is a full model's AdamW state: not
    LoRA adapters, not DeepSpeed's partitions, not PRIME's PRM)."""
    unsupported = (
        ("actor.optim.state_path", run.actor.optim.state_path, (
            ("model.lora_rank > 0", run.model.lora_rank > 0),
            ('actor.strategy = "deepspeed"', run.actor.strategy == "deepspeed"))),
        ("critic.optim.state_path", run.critic.optim.state_path, (
            ("critic.model.lora_rank > 0", run.critic.model.lora_rank > 0),)),
        ("reward_model.model.optim.state_path", run.reward_model.model.optim.state_path, (
            ("PRIME's PRM", True),)))
    for key, path, refusals in unsupported:
        if not path:
            continue
        for why, applies in refusals:
            if applies:
                raise ConfigError(source, key, f"not available with {why}: the imported "
                                  "state is a full model's AdamW state under FSDP2")
        if not (Path(path) / IMPORTED_OPTIMIZER_STATE).is_file():
            raise ConfigError(source, key, f"{path}: no {IMPORTED_OPTIMIZER_STATE} there; name the "
                              "folder `relay import-verl --optimizer` wrote (OUT/optimizer, "
                              "OUT/critic/optimizer)")


def check_timeouts(run: RunConfig, source: str) -> None:
    """A generator must give a lease back before the buffer expires it (``BufferConfig``)."""
    buffer = run.buffer
    if buffer.weights_timeout_s > buffer.lease_timeout_s:
        raise ConfigError(source, "buffer.weights_timeout_s",
                          f"{buffer.weights_timeout_s:g} s exceeds buffer.lease_timeout_s "
                          f"({buffer.lease_timeout_s:g} s): the buffer would expire and "
                          "re-lease a lease its generator still waits on; keep it at most "
                          "buffer.lease_timeout_s (0: equal to it)")


def check_resume(run: RunConfig, source: str) -> None:
    """``trainer.resume_from_path`` goes with ``trainer.resume_mode = "resume_path"`` and
    only with it. Whether the folder holds a complete checkpoint is checked at launch
    (``relay.launcher.resolve``): a running job may prune it later."""
    trainer = run.trainer
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        raise ConfigError(source, "trainer.resume_from_path",
                          "is empty, but trainer.resume_mode = 'resume_path' needs the "
                          "checkpoint folder (a step-<N> folder) to resume from")
    if trainer.resume_from_path and trainer.resume_mode != "resume_path":
        raise ConfigError(source, "trainer.resume_from_path",
                          f"is set, but trainer.resume_mode is {trainer.resume_mode!r}; set "
                          "trainer.resume_mode = 'resume_path' to resume from it")


def check_same_vocabulary(source: str, key: str, path: str, policy_path: str) -> None:
    """A critic or PRM reads the policy's token ids, so its vocabulary size must match."""
    sizes = [json.loads((Path(p) / "config.json").read_text()).get("vocab_size")
             for p in (path, policy_path)]
    if sizes[0] != sizes[1]:
        raise ConfigError(source, key,
                          f"vocab_size {sizes[0]} differs from the policy's ({sizes[1]}, "
                          f"model.path); it reads the policy's token ids, so it needs the "
                          "policy's tokenizer")


def check_algorithm_entries(run: RunConfig, source: str) -> None:
    """``algorithm.adv_estimator`` and ``actor.policy_loss.loss_mode`` name a built-in entry
    or a function by path that loads and whose signature takes what Relay passes it
    (``relay.algorithms.registry``). A user's entry by its registered name alone is refused:
    only this process imported its module, the buffer's and the learner's would not."""
    for key, name, lookup in (("algorithm.adv_estimator", run.algorithm.adv_estimator,
                               advantage_estimator),
                              ("actor.policy_loss.loss_mode", run.actor.policy_loss.loss_mode,
                               policy_loss_mode)):
        try:
            entry = lookup(name)
            check_protocol(entry)
        except ValueError as exc:
            raise ConfigError(source, key, str(exc)) from exc
        module = getattr(entry.function, "__module__", "")
        if not is_spec(name) and not module.startswith("relay."):
            code = getattr(entry.function, "__code__", None)
            where = f"{code.co_filename if code else module}:{entry.function.__name__}"
            raise ConfigError(source, key, f"{name!r} is registered by a module that only this "
                                           f"process imported; name its function by path, "
                                           f"'{where}' or 'module:function'")


def check_algorithm_sections(run: RunConfig, source: str) -> None:
    """Cross-key checks inside the sections defined in ``algorithms``."""
    correction = run.algorithm.rollout_correction
    lower, upper = correction.rs_bounds
    if correction.rollout_rs == "none":
        lower = upper  # the band is unused
    if lower > upper and correction.rollout_rs_threshold_lower:
        raise ConfigError(source, "algorithm.rollout_correction.rollout_rs_threshold_lower",
                          f"{lower} is above algorithm.rollout_correction.rollout_rs_threshold "
                          f"({upper}): no ratio would be accepted")
    if lower > upper:
        raise ConfigError(source, "algorithm.rollout_correction.rollout_rs_threshold",
                          f"{upper} is below 1, so its default lower bound 1 / {upper} is above "
                          "it and no ratio would be accepted; set rollout_rs_threshold_lower")
    policy_loss = run.actor.policy_loss
    if policy_loss.clip_cov_lb >= policy_loss.clip_cov_ub:
        raise ConfigError(source, "actor.policy_loss.clip_cov_lb",
                          f"{policy_loss.clip_cov_lb} must be below actor.policy_loss."
                          f"clip_cov_ub ({policy_loss.clip_cov_ub}): clip_cov picks tokens "
                          "whose covariance lies between them")


def check_algorithm_combinations(run: RunConfig, source: str) -> None:
    """Settings that each work but not together."""
    if run.actor.proximal_logprobs == "a3po" and run.trainer.publish_every > 1:
        raise ConfigError(source, "actor.proximal_logprobs",
                          "a3po interpolates by weight version and needs one version per "
                          f"learner step, but trainer.publish_every = "
                          f"{run.trainer.publish_every}; set trainer.publish_every = 1 or "
                          "actor.proximal_logprobs = 'recompute'")
    overlong = run.reward_model.overlong_buffer
    if overlong.enable and not 0 < overlong.len <= run.rollout.response_length:
        raise ConfigError(source, "reward_model.overlong_buffer.len",
                          f"must be in (0, rollout.response_length = "
                          f"{run.rollout.response_length}] when the overlong buffer is "
                          f"enabled, got {overlong.len}")
    prm = run.algorithm.adv_estimator if run.algorithm.estimator.prm else None
    check_reward_model(run, source, prm)
    if prm and overlong.enable:
        raise ConfigError(source, "reward_model.overlong_buffer.enable",
                          f"{prm} trains its PRM on the rewards as labels in [0, 1], and the "
                          "overlong penalty makes them negative; turn one of them off")
    if prm and run.algorithm.use_kl_in_reward:
        raise ConfigError(source, "algorithm.use_kl_in_reward",
                          f"{prm} builds its token rewards from the implicit PRM and does not "
                          "take a KL penalty in the reward; use actor.use_kl_loss instead")


def check_reward_model(run: RunConfig, source: str, prm: str | None) -> None:
    """Reward kwargs and a batch reward manager need a custom function; a judge needs exactly one of a
    model and a URL, a template with known fields, and no other learned reward beside it; a
    discriminative reward model (``reward_model.enable`` without PRIME) needs its path and
    a device the generators can name."""
    rewards = run.custom_reward_function
    if rewards.reward_kwargs and not rewards.path:
        raise ConfigError(source, "custom_reward_function.reward_kwargs",
                          f"{sorted(rewards.reward_kwargs)} are arguments for a custom reward "
                          "function, and the built-in rules take none: set "
                          "custom_reward_function.path to one")
    taken = sorted(set(rewards.reward_kwargs) & set(OWN_ARGUMENTS))
    if taken:
        raise ConfigError(source, "custom_reward_function.reward_kwargs",
                          f"{taken}: the reward function is called with those already")
    if rewards.reward_manager == "batch" and not rewards.path:
        raise ConfigError(source, "custom_reward_function.reward_manager",
                          "batch (verl's reward_model.reward_manager) calls a batch reward "
                          "function once per group: set custom_reward_function.path to it")
    rm = run.reward_model
    judge = rm.judge
    if judge.enable:
        if prm or rm.enable:
            raise ConfigError(source, "reward_model.judge.enable",
                              "a judge is the run's one learned reward: not beside "
                              + ("PRIME's implicit PRM" if prm else "reward_model.enable"))
        if bool(judge.model) == bool(judge.url):
            raise ConfigError(source, "reward_model.judge.model",
                              "give exactly one of reward_model.judge.model (served in the "
                              "generators or the [[reward_models]] processes) and "
                              "reward_model.judge.url (an OpenAI-compatible endpoint)")
        if problem := judge.template_problem():
            raise ConfigError(source, "reward_model.judge.prompt_template", problem)
    if not rm.enable or prm:
        return
    if not rm.model.path:
        raise ConfigError(source, "reward_model.model.path",
                          "reward_model.enable = true needs the reward model's folder "
                          "(a *ForSequenceClassification or *ForTokenClassification model, "
                          "or a causal LM with TRL's value head)")
    if rm.device and not DEVICE.fullmatch(rm.device):
        raise ConfigError(source, "reward_model.device",
                          f"{rm.device!r} is not a device: {DEVICES}, or empty for the "
                          "generator's own")


def check_replay(run: RunConfig, source: str) -> None:
    """``buffer.replay`` against the staleness bound and the advantage estimator."""
    replay = run.buffer.replay
    if replay.priority == "fifo":
        for key, value, default in (("max_reuse", replay.max_reuse, 1),
                                    ("max_age", replay.max_age, -1)):
            if value != default:
                raise ConfigError(source, f"buffer.replay.{key}",
                                  "applies to replay by priority, but buffer.replay.priority "
                                  "is 'fifo' (each group once, in order); set a priority "
                                  "('uniform', 'advantage', 'pass_rate', 'td_error')")
        return
    if replay.max_age > run.buffer.max_staleness:
        raise ConfigError(source, "buffer.replay.max_age",
                          f"{replay.max_age} is above buffer.max_staleness "
                          f"({run.buffer.max_staleness}): no group is trained on past the "
                          f"staleness bound")
    if replay.priority == "td_error" and not run.algorithm.estimator.critic:
        raise ConfigError(source, "buffer.replay.priority",
                          f"'td_error' needs the critic's values (an algorithm.adv_estimator "
                          f"with a critic, as 'gae'), got {run.algorithm.adv_estimator!r}")


def check_replay_filters(run: RunConfig, source: str) -> None:
    """The buffer's replay filters (``buffer.filter_groups``, ``buffer.pf_ppo``) and
    ``buffer.replay`` against the samples per prompt and the advantage estimator."""
    n = run.rollout.n
    if run.buffer.filter_groups.enable and n < 2:
        raise ConfigError(source, "buffer.filter_groups.enable",
                          f"dynamic sampling drops groups whose samples all score the same and "
                          f"needs at least 2 samples per prompt, got rollout.n = {n}")
    check_replay(run, source)
    pf_ppo = run.buffer.pf_ppo
    if not pf_ppo.enable:
        return
    kept = 1 if pf_ppo.mode == "best" else 2
    if n <= kept:
        raise ConfigError(source, "buffer.pf_ppo.mode",
                          f"{pf_ppo.mode!r} keeps {kept} of each prompt's samples and "
                          f"rollout.n = {n}: nothing would be filtered; raise rollout.n")
    estimator = run.algorithm.adv_estimator
    if kept == 1 and run.algorithm.estimator.group:
        raise ConfigError(source, "buffer.pf_ppo.mode",
                          f"'best' keeps one sample per prompt, but {estimator} compares the "
                          f"samples of a prompt with each other (every advantage would be 0); "
                          f"use 'best_random' or 'best_worst'")
