"""Typed schema of ``topology.toml``: where Relay's processes run and how they reach each other.

A topology says nothing about *what* is trained (that is the run config, ``relay.configs.run_schema``).
Every struct forbids unknown keys; ``relay.configs.loader`` turns decoding failures into errors that
name the file and the key.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]  # 0: pick a free port at launch
Threads = Annotated[int, msgspec.Meta(ge=0)]  # 0: torch's default
GpuIndex = Annotated[int, msgspec.Meta(ge=0)]  # a GPU of its host: CUDA_VISIBLE_DEVICES's index
Cpus = Annotated[float, msgspec.Meta(ge=0)]
MemoryGiB = Annotated[float, msgspec.Meta(ge=0)]  # 0: not accounted
BackendName = Literal["local", "ssh", "ray", "slurm"]
"""How the launcher starts the plan's processes (``relay.launcher.backends``): on this machine,
on hosts reached over ssh, as Ray actors, or as the steps of one Slurm job."""


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every topology section."""


class _Resources(_Section):
    """What one process asks of its node, checked before anything starts
    (``relay.launcher.resources``) and given to Ray or Slurm as the process's reservation:
    ``cpus`` cores, ``memory_gib`` GiB of memory (0: not accounted) and ``resources``, Ray's
    custom resources (``{"node_a" = 1}`` pins a process to the node that offers it). Its
    GPUs follow from its device: none on the CPU, else its ``gpus`` list's length or, with
    no list, one (vLLM and SGLang: their tensor-parallel size; the learner: one per rank)."""

    cpus: Cpus = 1.0
    memory_gib: MemoryGiB = 0.0
    resources: dict[str, Annotated[float, msgspec.Meta(ge=0)]] = msgspec.field(
        default_factory=dict)


class BufferPlacement(_Resources):
    """The hub process. Generators and the learner connect to ``tcp://host:port``."""

    host: str = "127.0.0.1"
    port: Port = 7450


class LearnerPlacement(_Resources):
    """The learner, started with torchrun: ``len(hosts) * nproc_per_node`` ranks.

    Rank 0 runs on ``hosts[0]``: it streams weight versions on ``weights_stream_port`` and
    answers which version is newest (and evaluation requests) on ``weights_port``. With
    several hosts, ``hosts[0]:master_port`` is torchrun's rendezvous; one host uses
    ``torchrun --standalone``.

    ``gpus``: the GPUs of each learner host, one per local rank (``len(gpus) ==
    nproc_per_node``, the same list on every host): the launcher starts torchrun with
    ``CUDA_VISIBLE_DEVICES`` set to them, so local rank i runs on ``gpus[i]`` (which it
    sees as ``cuda:i``). Unset (None): ``CUDA_VISIBLE_DEVICES`` is left as it is and local
    rank i takes ``cuda:i``.

    Under Ray and Slurm the backend picks the hosts: ``nnodes`` nodes of
    ``nproc_per_node`` ranks each (0: ``len(hosts)``), and ``cpus``, ``memory_gib`` and
    ``resources`` are each rank's.
    """

    hosts: Annotated[list[str], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: ["127.0.0.1"]
    )
    nproc_per_node: Annotated[int, msgspec.Meta(ge=1)] = 1
    nnodes: Annotated[int, msgspec.Meta(ge=0)] = 0
    master_port: Port = 29517
    weights_port: Port = 7451
    weights_stream_port: Port = 7453
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    gpus: list[GpuIndex] | None = None
    threads: Threads = 0


EngineName = Literal["lean", "torch", "hf", "vllm", "sglang"]
"""The inference engines (``relay.generators.build``): Relay's own (lean, torch, hf), vLLM and
SGLang."""


class EngineOptions(_Section):
    """The options vLLM and SGLang share, under verl's names (``actor_rollout_ref.rollout.*``);
    ``VLLMOptions`` and ``SGLangOptions`` say what each engine makes of them."""

    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5  # GPU only
    tensor_model_parallel_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    enforce_eager: bool = True
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: Annotated[int, msgspec.Meta(ge=1)] = 8192
    max_model_len: Annotated[int, msgspec.Meta(ge=0)] = 0  # 0: prompt + response length
    engine_kwargs: dict[str, object] = msgspec.field(default_factory=dict)


class VLLMOptions(EngineOptions):
    """Engine options of a generator whose engine is ``vllm`` (``relay.generators.vllm_engine``),
    under verl's names (``actor_rollout_ref.rollout.*``). The batch (``max_num_seqs``) is
    the run's ``rollout.max_num_seqs``; the context length defaults to the run's
    ``data.max_prompt_length + rollout.response_length``.

    ``engine_kwargs`` go to ``vllm.LLM`` as they are, last (verl's
    ``rollout.engine_kwargs.vllm``): any engine argument not named here.

    ``enable_lora`` (with the run's ``model.lora_rank`` > 0, as verl turns it on): vLLM's
    LoRA support runs the policy's adapters over the base model, and when every engine of
    the topology takes them so the learner publishes the adapters alone
    (``relay.configs.lora_publish``); off, vLLM takes merged weights as the other engines.
    """

    kv_cache_gib: Annotated[float, msgspec.Meta(gt=0)] = 1.0  # CPU only: the KV cache's size
    enable_lora: bool = True


class SGLangOptions(EngineOptions):
    """Engine options of a generator whose engine is ``sglang`` (``relay.generators.sglang_engine``),
    under verl's names (``actor_rollout_ref.rollout.*``), each turned into SGLang's server
    argument: ``gpu_memory_utilization`` is ``mem_fraction_static``,
    ``tensor_model_parallel_size`` is ``tp_size``, ``enforce_eager`` is
    ``disable_cuda_graph``, ``max_model_len`` is ``context_length``, and
    ``max_num_batched_tokens`` is ``chunked_prefill_size`` (-1, SGLang's off, when
    ``enable_chunked_prefill`` is false). The batch (``max_running_requests``) is the run's
    ``rollout.max_num_seqs``; the context length defaults to the run's
    ``data.max_prompt_length + rollout.response_length``.

    ``engine_kwargs`` go to ``sglang.Engine`` as they are, last (verl's
    ``rollout.engine_kwargs.sglang``): any server argument not named here.
    """


class LeanOptions(_Section):
    """Engine options of a generator whose engine is ``lean`` (``relay.generators.lean_engine``),
    under verl's names: on a GPU its KV cache takes what ``gpu_memory_utilization`` of the
    memory free at start leaves after the weights, the next version's copy of them and a
    step's workspace (every sequence at full length when that fits, else a paged pool:
    ``relay.generators.kv_cache``); on the CPU every sequence at full length. A prefill takes at most max(``max_num_batched_tokens``, the
    context length) padded prompt tokens on every device.
    """

    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5  # GPU only
    max_num_batched_tokens: Annotated[int, msgspec.Meta(ge=1)] = 8192


class EnginePlacement(_Resources):
    """A process that runs an inference engine on a device (a generator, the evaluator);
    ``lean``, ``vllm`` and ``sglang`` hold those engines' options.

    ``gpus``: the GPUs of its host the process owns. The launcher starts it with
    ``CUDA_VISIBLE_DEVICES`` set to them and its ``device`` is then ``"cuda"``: Relay's
    engines run on ``gpus[0]`` (one GPU), vLLM and SGLang on the first
    ``tensor_model_parallel_size`` of them. Unset (None): ``CUDA_VISIBLE_DEVICES`` is left
    as it is and ``device`` names the GPU (``"cuda:1"``). Two processes on one host never
    share a GPU they list (``relay.configs.checks.check_gpu_placement``).
    """

    host: str = "127.0.0.1"
    engine: EngineName = "lean"
    device: str = "cpu"
    gpus: list[GpuIndex] | None = None
    threads: Threads = 0
    lean: LeanOptions = msgspec.field(default_factory=LeanOptions)
    vllm: VLLMOptions = msgspec.field(default_factory=VLLMOptions)
    sglang: SGLangOptions = msgspec.field(default_factory=SGLangOptions)


class GeneratorPlacement(EnginePlacement, kw_only=True):
    """One generator process, named (its ``[[generators]]`` entry). A generator that dies
    before the run ends is started again under its name, at most ``max_restarts`` times,
    after a wait that doubles from one second (``relay.launcher.supervisor``)."""

    name: str
    max_restarts: Annotated[int, msgspec.Meta(ge=0)] = 3


class EvaluatorPlacement(EnginePlacement):
    """The evaluator process (``relay.generators.evaluator``): held-out evaluation of the weights
    the learner offers, with its own engine. Started only when the run config has
    validation data to evaluate on (``RunConfig.evaluates``)."""


class RewardModelPlacement(_Resources, kw_only=True):
    """A reward server (its ``[[reward_models]]`` entry, ``relay.generators.reward_server``):
    the run's discriminative reward model (``reward_model.enable``) and/or LLM judge
    (``reward_model.judge``) on a device of its own, answering the generators' batched
    score requests at ``tcp://host:port`` (an ``ipc://`` file without CURVE, as every
    address of a one-machine run). With one or more entries every generator sends its
    samples to them, round-robin, instead of loading the scorer itself; with none the
    scorer runs inside each generator (the default).

    ``device``, ``gpus`` and ``threads`` as a generator's; the judge's engine is the run
    config's ``reward_model.judge.engine`` (any of Relay's engines, vLLM and SGLang
    included), with its options from ``lean``, ``vllm`` or ``sglang`` here.
    ``timeout_s``: how long a generator waits for one reply before it tries the next server
    (the same one when there is one), until ``buffer.client_patience_s`` has passed; then
    its sender fails, and the generator with it (``relay.generators.reward_client``). A
    reward server is essential: if it dies the launcher stops the run, as for the buffer.
    """

    name: str
    host: str = "127.0.0.1"
    port: Port = 7460
    device: str = "cpu"
    gpus: list[GpuIndex] | None = None
    threads: Threads = 0
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0
    lean: LeanOptions = msgspec.field(default_factory=LeanOptions)
    vllm: VLLMOptions = msgspec.field(default_factory=VLLMOptions)
    sglang: SGLangOptions = msgspec.field(default_factory=SGLangOptions)

    def engine_placement(self, engine: EngineName) -> GeneratorPlacement:
        """This server as the placement of an ``engine`` that ``relay.generators.build``
        builds (the judge's), under its own name, device and engine options."""
        return GeneratorPlacement(name=self.name, host=self.host, engine=engine,
                                  device=self.device, gpus=self.gpus, threads=self.threads,
                                  cpus=self.cpus, memory_gib=self.memory_gib,
                                  resources=dict(self.resources), lean=self.lean,
                                  vllm=self.vllm, sglang=self.sglang)


class Security(_Section):
    """CURVE encryption and authentication, required for any non-loopback address.

    ``keys_dir`` holds ``server.key_secret`` and one ``*.key`` per authorized client
    (``tools/make-curve-keys.py`` writes them); relative paths are resolved against the
    topology file.

    Without CURVE every process runs on this machine, and the run's sockets are not ports
    but ``ipc://`` files in ``sockets_dir`` (default: the run directory's ``sockets/``),
    which the launcher makes 0700: another user of the machine can neither connect to them
    nor bind them (``relay.configs.rundir``). Its path plus the longest socket name must fit a
    Unix socket's 107 characters; set a short ``sockets_dir`` (a folder of your own) when
    the run directory's path is too long. With CURVE the ports below are used, loopback
    included.
    """

    curve: bool = False
    keys_dir: str = ""
    sockets_dir: str = ""


class RaySettings(_Section):
    """The Ray backend (``launcher.backend = "ray"``, ``relay.launcher.ray_backend``):
    ``address`` of a running cluster (``"auto"``, ``"ray://head:10001"``, ``"head:6379"``;
    empty: start a Ray instance on this machine, of ``num_cpus`` CPUs and ``num_gpus`` GPUs
    when set: verl's ``ray_init.num_cpus``), the actors' ``namespace``, and how long the
    processes' reservations may wait for resources (``placement_timeout_s``) before the
    launch is refused naming what could not be placed. The run directory must be at the
    same path on every node (a shared filesystem)."""

    address: str = ""
    namespace: str = "relay"
    num_cpus: Annotated[int, msgspec.Meta(ge=0)] | None = None
    num_gpus: Annotated[int, msgspec.Meta(ge=0)] | None = None
    placement_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0


class SlurmSettings(_Section):
    """The Slurm backend (``launcher.backend = "slurm"``, ``relay.launcher.slurm``): the job's
    ``partition``, ``account``, ``qos`` and ``time`` limit (empty: the cluster's default),
    ``gpus_per_node`` and ``cpus_per_node`` it asks for (0: as the plan needs), further
    ``#SBATCH`` options as they are (``sbatch = ["--exclusive"]``), and ``setup``: shell
    lines run first in the job (``module load``, activating an environment)."""

    job_name: str = "relay"
    partition: str = ""
    account: str = ""
    qos: str = ""
    time: str = ""
    gpus_per_node: Annotated[int, msgspec.Meta(ge=0)] = 0
    cpus_per_node: Annotated[int, msgspec.Meta(ge=0)] = 0
    sbatch: list[str] = msgspec.field(default_factory=list)
    setup: list[str] = msgspec.field(default_factory=list)


class LauncherSettings(_Section):
    """The launcher: which ``backend`` starts the processes (``local``: every one on this
    machine; ``ssh``: hosts named in the topology, reached with ``ssh``; ``ray``: actors of a
    Ray cluster, ``[launcher.ray]``; ``slurm``: steps of one Slurm job,
    ``[launcher.slurm]``), where processes send their metrics (``host:metrics_port``, the
    launcher's own address) and how ssh reaches remote hosts."""

    backend: BackendName = "local"
    host: str = "127.0.0.1"
    metrics_port: Port = 7452
    ssh: str = "ssh"
    remote_python: str = "python3"
    remote_workdir: str = ""
    ray: RaySettings = msgspec.field(default_factory=RaySettings)
    slurm: SlurmSettings = msgspec.field(default_factory=SlurmSettings)


class Topology(_Section):
    """The whole of ``topology.toml``."""

    buffer: BufferPlacement = msgspec.field(default_factory=BufferPlacement)
    learner: LearnerPlacement = msgspec.field(default_factory=LearnerPlacement)
    generators: Annotated[list[GeneratorPlacement], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: [GeneratorPlacement(name="gen0")]
    )
    evaluator: EvaluatorPlacement = msgspec.field(default_factory=EvaluatorPlacement)
    reward_models: list[RewardModelPlacement] = msgspec.field(default_factory=list)
    security: Security = msgspec.field(default_factory=Security)
    launcher: LauncherSettings = msgspec.field(default_factory=LauncherSettings)
