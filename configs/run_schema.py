"""Typed schema of a run config: what a Relay run trains, on what, and how.

Section and key names follow verl's (``data.train_batch_size``, ``actor.clip_ratio_high``,
``algorithm.adv_estimator``...) so that its users feel at home; Relay-only keys are marked.
Every struct forbids unknown keys; ``relay.configs.loader`` turns decoding failures into errors that
name the file and the key. Paths are resolved against the config file's folder by the loader.

A section that configures one piece of ``algorithms`` is defined beside that code and
composed here, so each knob is defined once: ``actor.policy_loss``
(``relay.algorithms.policy_loss.PolicyLossConfig``), ``algorithm.kl_ctrl``
(``relay.algorithms.kl.KLControlConfig``), ``algorithm.rollout_correction``
(``relay.algorithms.off_policy.RolloutCorrectionConfig``), ``custom_reward_function``
(``relay.algorithms.rewards.config.RewardConfig``) and ``sandbox``
(``relay.algorithms.sandbox.config.SandboxSettings``; verl's
``reward_model.sandbox_fusion.*`` keys are its ``sandbox.sandbox_fusion.*``).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from relay.algorithms.advantages import DEFAULT_ESTIMATOR
from relay.algorithms.aggregation import LossAggMode
from relay.algorithms.kl import KLControlConfig, KLType
from relay.algorithms.off_policy import RolloutCorrectionConfig
from relay.algorithms.policy_loss import PolicyLossConfig
from relay.algorithms.registry import AdvantageEntry, advantage_estimator
from relay.algorithms.rewards.config import RewardConfig
from relay.algorithms.sandbox.config import SandboxSettings

Positive = Annotated[int, msgspec.Meta(gt=0)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]
FsdpSize = Annotated[int, msgspec.Meta(ge=-1)]
"""verl's ``fsdp_size``: -1 shards a model over every learner rank; k, a divisor of the W
ranks, shards it within groups of k and replicates it across the W / k groups (HSDP,
``relay.learner.model.sharding_mesh``; the learner refuses any other value naming the key)."""

# verl's names for sections that live elsewhere here, accepted in files and overrides. PF-PPO
# has none: verl's algorithm.pf_ppo reweights batch-wide, buffer.pf_ppo filters per group.
# verl's other keys, and what Relay does with each: relay.configs.verl_keys.
VERL_ALIASES = {("algorithm", "filter_groups"): ("buffer", "filter_groups"),
                ("actor_rollout_ref", "actor"): ("actor",),
                ("actor_rollout_ref", "rollout"): ("rollout",),
                ("actor_rollout_ref", "model"): ("model",),
                ("actor_rollout_ref", "ref"): ("ref",)}
PfPpoMode = Literal["best", "best_random", "best_worst"]  # buffer.pf_ppo
ReplayPriority = Literal["fifo", "uniform", "advantage", "pass_rate", "td_error"]  # buffer.*
# trainer.resume_allow_changes: the keys whose values the buffer's saved state holds under
# (relay.buffer.fingerprint), in the order a refused resume names them
FingerprintKey = Literal["data.train_files", "data.seed", "data.shuffle",
                         "data.train_batch_size", "rollout.n", "model.path"]
BUILTIN_MODEL_PREFIX = "builtin:"  # model.path = "builtin:tiny-arith": built and cached on demand


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every run-config section."""


class DataConfig(_Section):
    """Prompt datasets in verl's schema (parquet or JSONL) and the batch size.

    ``train_batch_size`` counts prompts per learner step; each prompt yields ``rollout.n``
    samples (verl's meaning). ``prompt_key`` names the column that holds each row's chat
    messages (``relay.configs.prompt_data``). A prompt longer than ``max_prompt_length``
    tokens (after the chat template) is, by ``truncation``: ``error``, refused when the
    buffer loads the data, naming the row; ``left``, cut to its last ``max_prompt_length``
    tokens (Relay's default; verl's is ``error``); ``right``, cut to its first; ``middle``,
    to its first and last halves (``relay.configs.prompt_data.truncate_prompt``).
    ``filter_overlong_prompts`` drops such rows from the training data when the buffer
    loads it, and logs how many.
    ``shuffle``: a new permutation of the rows each epoch, seeded by ``seed``.
    """

    train_files: str | list[str]
    val_files: str | list[str] = msgspec.field(default_factory=list)
    prompt_key: Annotated[str, msgspec.Meta(min_length=1)] = "prompt"
    train_batch_size: Positive = 32
    max_prompt_length: Positive = 512
    truncation: Literal["error", "left", "right", "middle"] = "left"
    filter_overlong_prompts: bool = False
    shuffle: bool = True
    seed: int = 0


def _hydra_lists(section: _Section, *keys: str) -> None:
    """Hydra's bare list, ``[q_proj,v_proj]``, as the list it means (verl's commands)."""
    for key in keys:
        value = getattr(section, key)
        if isinstance(value, str) and value.startswith("[") and value.endswith("]"):
            setattr(section, key, [n.strip().strip("'\"") for n in value[1:-1].split(",")
                                   if n.strip()])


class ModelConfig(_Section):
    """The policy: a local Hugging Face checkpoint loaded with the Auto classes.

    ``dtype`` is the compute dtype of the learner's forward/backward (parameters and the
    optimizer stay fp32) and of the generators' engines. ``enable_gradient_checkpointing``
    (verl's key) recomputes each transformer block's activations in the backward instead of
    keeping them (transformers' gradient checkpointing), for every model the learner trains.

    LoRA (verl's keys; ``relay.learner.lora``): ``lora_rank`` > 0 trains peft LoRA adapters
    of rank r on the policy's ``target_modules`` (peft's spelling: ``"all-linear"``, a
    regular expression, or a list of module names such as ``["q_proj", "v_proj"]``, Hydra's
    ``[q_proj,v_proj]`` too) less ``exclude_modules``, scaled by ``lora_alpha`` / r; the
    base weights stay frozen (no gradients, no optimizer state), the reference is the
    policy with its adapters disabled, and generators get the merged weights
    W + (alpha / r) B A.
    ``lora_adapter_path`` (Relay's key, as verl's newer one): a peft adapter folder
    (``adapter_config.json``, ``adapter_model.safetensors``) to start from instead of fresh
    adapters; its rank must be ``lora_rank``. 0 (the default): every parameter trains.
    """

    path: str
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    trust_remote_code: bool = False
    enable_gradient_checkpointing: bool = False
    lora_rank: NonNegative = 0
    lora_alpha: PositiveFloat = 16.0
    target_modules: str | list[str] = "all-linear"
    exclude_modules: str | list[str] | None = None
    lora_adapter_path: str | None = None

    def __post_init__(self) -> None:
        _hydra_lists(self, "target_modules", "exclude_modules")


class ValKwargs(_Section):
    """Sampling for held-out evaluation; temperature 0 is greedy (verl's default), and so is
    ``do_sample = false`` whatever the temperature (verl's key; its default is false, Relay's
    true, since the temperature already says it)."""

    temperature: NonNegativeFloat = 0.0
    top_p: Fraction = 1.0
    top_k: int = -1
    n: Positive = 1
    do_sample: bool = True

    @property
    def sampling_temperature(self) -> float:
        """The temperature decoding uses: 0 (greedy) unless ``do_sample``."""
        return self.temperature if self.do_sample else 0.0


class MultiTurnConfig(_Section):
    """Multi-turn rollouts with tool calls (verl's ``rollout.multi_turn``; the loop is
    ``relay.generators.tool_loop``). Each episode is one sample: the prompt (rendered with
    the tools' schemas), then assistant turns with the tool responses between them, all
    within ``rollout.response_length`` tokens; the learner trains on the assistant's
    tokens only.

    ``tool_config_path``: verl's tool YAML (``relay.generators.tools.loader``).
    ``max_assistant_turns`` / ``max_user_turns`` (tool-response turns): None, no limit but
    the response length. A turn's calls (``format``: hermes ``<tool_call>`` JSON) run
    concurrently, the first ``max_parallel_calls`` of them, each within ``tool_timeout_s``
    (Relay's key); a response is cut to ``max_tool_response_length`` characters on
    ``tool_response_truncate_side``. ``interaction_config_path``: verl's interaction YAML,
    simulated users that reply to a turn that called no tool
    (``relay.generators.tools.interaction``); tool responses and their replies count as
    user turns.
    """

    enable: bool = False
    max_assistant_turns: Positive | None = None
    max_user_turns: Positive | None = None
    max_parallel_calls: Positive = 1
    max_tool_response_length: Positive = 256
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    tool_config_path: str = ""
    interaction_config_path: str = ""
    format: Literal["hermes"] = "hermes"
    tool_timeout_s: PositiveFloat = 30.0


class RolloutConfig(_Section):
    """Sampling on the generators: tokens are drawn from the processed distribution
    (temperature, then top-k, then top-p), and their behavior log-probs are the
    temperature-only ones the learner recomputes (``relay.generators.sampling``).

    ``workflow`` (Relay; AReaL's ``RolloutWorkflow``): the user's own episode function,
    ``"my_pkg.agent:run_episode"`` or ``"path/to/agent.py:run_episode"``
    (``relay.generators.workflow``); ``multi_turn`` runs Relay's tool loop, itself one
    such workflow.
    """

    n: Positive = 8
    temperature: PositiveFloat = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    top_k: int = -1  # -1: off
    response_length: Positive = 512
    prompts_per_lease: Positive = 8  # Relay: prompts a generator leases per request
    max_num_seqs: Positive = 256  # vLLM's name: sequences a generator keeps in flight
    update_weights_bucket_megabytes: Positive = 128  # weights stream in buckets this large
    val_kwargs: ValKwargs = msgspec.field(default_factory=ValKwargs)
    multi_turn: MultiTurnConfig = msgspec.field(default_factory=MultiTurnConfig)
    workflow: str = ""


IMPORTED_OPTIMIZER_STATE = "state.json"
"""The file that makes a folder an imported AdamW state (``OptimConfig.state_path``)."""


class OptimConfig(_Section):
    """AdamW with linear warm-up then a constant or cosine schedule (verl's names).

    ``state_path`` (Relay's key; the policy's and the critic's): a folder of AdamW state
    that ``relay import-verl --optimizer`` wrote (``OUT/optimizer``, ``OUT/critic/optimizer``).
    A run that starts fresh takes its moments and step count instead of zeros
    (``relay.learner.imported_optimizer``); a resumed run has its own in its checkpoint.
    """

    lr: PositiveFloat = 1e-6
    weight_decay: NonNegativeFloat = 0.01
    betas: Annotated[list[float], msgspec.Meta(min_length=2, max_length=2)] = msgspec.field(
        default_factory=lambda: [0.9, 0.999]
    )
    lr_warmup_steps: int = -1  # -1: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: Fraction = 0.0
    warmup_style: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: Fraction = 0.0
    state_path: str = ""


class FsdpConfig(_Section):
    """Where FSDP2 keeps what a learner rank holds (verl's ``actor.fsdp_config``).

    ``param_offload`` keeps the parameters' shards, their gradients and the optimizer step on
    the CPU (FSDP2's ``CPUOffloadPolicy``), copying each block to the device for its forward
    and backward; ``optimizer_offload`` keeps the optimizer's state on the CPU between steps
    and brings it to the device for each step. Both apply to the policy (and the parameter
    offload to the frozen reference). On a CPU learner everything is on the CPU already.
    ``fsdp_size`` (``FsdpSize``) says over how many ranks the policy is sharded (and the
    frozen reference, and PRIME's PRM); the rest replicate it (HSDP): -1, every rank, or,
    on many hosts, the ranks of one or a few hosts, so that gathering weights stays on
    fast links, as verl's DAPO recipe does with 32.
    """

    param_offload: bool = False
    optimizer_offload: bool = False
    fsdp_size: FsdpSize = -1


class DeepSpeedConfig(_Section):
    """DeepSpeed ZeRO for the policy (``actor.strategy = "deepspeed"``, OpenRLHF's names).

    ``zero_stage`` 2 partitions gradients and optimizer state over the ranks (each holds
    the whole model), 3 the parameters too (gathered block by block for each pass);
    ``offload_optimizer`` (OpenRLHF's ``--adam_offload``) keeps the optimizer's state and
    step on the CPU; ``offload_param`` (stage 3) the parameters too. The update is the one
    FSDP2 makes (``relay.learner.deepspeed_engine``).
    """

    zero_stage: Literal[2, 3] = 2
    offload_optimizer: bool = False
    offload_param: bool = False

    def __post_init__(self) -> None:
        if self.offload_param and self.zero_stage != 3:
            raise ValueError("actor.deepspeed.offload_param needs zero_stage = 3 (ZeRO-2 keeps "
                             "the whole model on every rank)")


class ActorConfig(_Section):
    """The policy update (verl's ``actor_rollout_ref.actor``).

    ``clip_ratio_low`` / ``clip_ratio_high`` / ``clip_ratio_c`` clip the ratio of every
    ``policy_loss.loss_mode`` that clips (``relay.algorithms.policy_loss``). ``loss_agg_mode``
    aggregates the policy loss, except for the per-sequence objectives gspo, sapo and
    geo_mean, which are always aggregated per sequence as verl does (the learner logs it),
    and the entropy and KL-loss terms. ``ppo_mini_batch_size`` counts prompts per optimizer
    step; ``ppo_micro_batch_size_per_gpu`` counts sequences per forward/backward, or with
    ``use_dynamic_bsz`` each pass holds rows of like length up to
    ``ppo_max_token_len_per_gpu`` padded tokens (``relay.learner.micro_batches``).
    ``skip_zero_advantage`` (Relay) skips the forward and backward passes of rows whose
    advantages are all zero (a GRPO group whose samples all scored the same) when their
    loss and gradient are exactly zero: a loss mode whose registry entry says so
    (``zero_advantage_zero_gradient``), no entropy bonus, no KL loss. The
    loss keeps its denominators, so the update is the same; the actor's diagnostics then
    describe the rows trained on.
    ``share_prompts`` (Relay) runs the samples of a prompt group as one sequence, the prompt
    computed once and each response attending to it (``relay.learner.shared_prompts``; the same
    log-probs and gradients for fewer tokens) in the Llama, Qwen2, Qwen3 and Mistral
    families without sliding windows; other models run rows. With it, passes hold whole
    groups and ``ppo_max_token_len_per_gpu`` counts packed tokens.
    ``proximal_logprobs`` (Relay) says how the proximal policy's log-probs are obtained when
    a step makes several updates: ``recompute`` runs a forward pass with the weights before
    the step; ``a3po`` interpolates between behavior and current log-probs by version
    (A-3PO) and skips it, unless the batch needs them before the first update anyway (KL in
    the reward, rejection by ``algorithm.rollout_correction``), when they are recomputed.
    ``ulysses_sequence_parallel_size`` (verl's key) is the number of learner ranks that
    split the tokens of each pass (Ulysses sequence parallelism, ``relay.learner.ulysses``): it
    must divide the learner's ranks and the model's attention heads, and it applies to every
    model the learner runs (the policy, the reference, the critic and the PRM). Under it
    passes run rows packed without padding (``share_prompts`` is not applied).
    ``strategy`` (verl's key): ``fsdp2`` (``fsdp`` names it too) shards the policy with
    FSDP2 (``fsdp_config``); ``deepspeed`` trains it in a DeepSpeed ZeRO engine
    (``deepspeed``; the ``deepspeed`` extra) under the same losses, passes and publish.
    """

    clip_ratio_low: NonNegativeFloat = 0.2
    clip_ratio_high: NonNegativeFloat = 0.2
    clip_ratio_c: Annotated[float, msgspec.Meta(gt=1)] = 3.0
    loss_agg_mode: LossAggMode = "token-mean"
    policy_loss: PolicyLossConfig = msgspec.field(default_factory=PolicyLossConfig)
    use_kl_loss: bool = False
    kl_loss_type: KLType = "low_var_kl"
    kl_loss_coef: NonNegativeFloat = 0.001
    entropy_coeff: float = 0.0
    grad_clip: PositiveFloat = 1.0
    ppo_epochs: Positive = 1
    ppo_mini_batch_size: NonNegative = 0  # 0: the whole train batch (one update per step)
    ppo_micro_batch_size_per_gpu: Positive = 64
    use_dynamic_bsz: bool = False  # cut passes by token budget instead of row count
    ppo_max_token_len_per_gpu: Positive = 16384  # rows x longest row a pass (x P under SP)
    proximal_logprobs: Literal["recompute", "a3po"] = "recompute"  # Relay
    skip_zero_advantage: bool = True  # Relay: no passes over rows whose advantages are all 0
    share_prompts: bool = True  # Relay: one sequence per prompt group, the prompt computed once
    ulysses_sequence_parallel_size: Positive = 1  # ranks that split each pass's tokens
    use_torch_compile: bool = False  # compile the policy's norms and MLPs
    strategy: Literal["fsdp", "fsdp2", "deepspeed"] = "fsdp2"  # fsdp: FSDP2 too
    fsdp_config: FsdpConfig = msgspec.field(default_factory=FsdpConfig)
    deepspeed: DeepSpeedConfig = msgspec.field(default_factory=DeepSpeedConfig)
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)


class RefFsdpConfig(_Section):
    """Where FSDP2 keeps the frozen reference's shards (verl's ``ref.fsdp_config``)."""

    param_offload: bool | None = None  # None: actor.fsdp_config.param_offload
    fsdp_size: FsdpSize | None = None  # None: actor.fsdp_config.fsdp_size


class RefConfig(_Section):
    """The frozen reference model's log-prob passes (verl's ``actor_rollout_ref.ref``).

    The reference is loaded when a KL term needs it (``actor.use_kl_loss``,
    ``algorithm.use_kl_in_reward``) or PRIME's PRM shares it. Its passes run once per step
    over the whole batch, without gradients, so they may be cut larger than the actor's:
    ``log_prob_micro_batch_size_per_gpu`` rows a pass, or with ``log_prob_use_dynamic_bsz``
    up to ``log_prob_max_token_len_per_gpu`` padded tokens a pass (``relay.learner.micro_batches``).
    Every key left unset (None) takes the actor's value, as verl's interpolations do
    (``ppo_micro_batch_size_per_gpu``, ``use_dynamic_bsz``, ``ppo_max_token_len_per_gpu``,
    ``fsdp_config.param_offload``, ``fsdp_config.fsdp_size``).
    ``ulysses_sequence_parallel_size`` must equal the actor's: every model of the learner
    runs on one sequence-parallel mesh.
    """

    log_prob_micro_batch_size_per_gpu: Positive | None = None
    log_prob_use_dynamic_bsz: bool | None = None
    log_prob_max_token_len_per_gpu: Positive | None = None
    ulysses_sequence_parallel_size: Positive | None = None
    fsdp_config: RefFsdpConfig = msgspec.field(default_factory=RefFsdpConfig)

    def resolve(self, actor: ActorConfig) -> RefConfig:
        """This section with every unset key taken from ``actor`` (class docstring)."""
        def pick(own, actors):  # noqa: ANN001, ANN202 - one value of either type
            return actors if own is None else own

        return RefConfig(
            log_prob_micro_batch_size_per_gpu=pick(self.log_prob_micro_batch_size_per_gpu,
                                                   actor.ppo_micro_batch_size_per_gpu),
            log_prob_use_dynamic_bsz=pick(self.log_prob_use_dynamic_bsz, actor.use_dynamic_bsz),
            log_prob_max_token_len_per_gpu=pick(self.log_prob_max_token_len_per_gpu,
                                                actor.ppo_max_token_len_per_gpu),
            ulysses_sequence_parallel_size=pick(self.ulysses_sequence_parallel_size,
                                                actor.ulysses_sequence_parallel_size),
            fsdp_config=RefFsdpConfig(param_offload=pick(self.fsdp_config.param_offload,
                                                         actor.fsdp_config.param_offload),
                                      fsdp_size=pick(self.fsdp_config.fsdp_size,
                                                     actor.fsdp_config.fsdp_size)))


class AlgorithmConfig(_Section):
    """Advantage estimation, KL in the reward and off-policy correction (verl's ``algorithm``).

    ``gae`` trains a critic (the ``critic`` section); with ``remax`` the generators also
    decode one greedy response per prompt, whose reward is the baseline; ``prime`` (*Relay*
    name; verl's PRIME recipe runs it as its ``rloo``) trains an implicit process reward
    model (the ``reward_model`` section) and weighs its token rewards by
    ``reward_dpo_coef`` and the outcome rewards by ``reward_gt_coef``. ``adv_estimator`` is a
    name of ``relay.algorithms.registry`` or a user's function by path,
    ``"my_pkg.adv:my_est"`` or ``"path/to/file.py:my_est"``; one that does not load or whose
    signature does not fit is refused when the config loads.
    """

    adv_estimator: str = DEFAULT_ESTIMATOR  # an AdvEstimator, or a function by path
    norm_adv_by_std_in_grpo: bool = True
    gamma: Fraction = 1.0
    lam: Fraction = 1.0
    use_kl_in_reward: bool = False
    kl_penalty: KLType = "kl"
    kl_ctrl: KLControlConfig = msgspec.field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = msgspec.field(
        default_factory=RolloutCorrectionConfig)
    reward_dpo_coef: NonNegativeFloat = 5.0  # prime: weight of the implicit process rewards
    reward_gt_coef: NonNegativeFloat = 5.0  # prime: weight of the outcome rewards

    @property
    def estimator(self) -> AdvantageEntry:
        """``adv_estimator``'s registry entry: what it needs (``relay.algorithms.registry``)."""
        return advantage_estimator(self.adv_estimator)


class CriticFsdpConfig(_Section):
    """How FSDP2 shards the critic (verl's ``critic.model.fsdp_config``)."""

    fsdp_size: FsdpSize = -1  # as actor.fsdp_config.fsdp_size, for the critic (verl's default)


class CriticModelConfig(_Section):
    """The critic's body: empty ``path`` initialises it from the policy checkpoint.

    LoRA (verl's keys, as the policy's ``model`` ones; ``relay.learner.lora``): ``lora_rank``
    > 0 trains adapters of rank r on the body's ``target_modules`` less ``exclude_modules``,
    scaled by ``lora_alpha`` / r, and the value head whole; the body's base weights stay
    frozen. 0 (the default): every parameter trains.
    """

    path: str = ""
    fsdp_config: CriticFsdpConfig = msgspec.field(default_factory=CriticFsdpConfig)
    lora_rank: NonNegative = 0
    lora_alpha: PositiveFloat = 16.0
    target_modules: str | list[str] = "all-linear"
    exclude_modules: str | list[str] | None = None

    def __post_init__(self) -> None:
        _hydra_lists(self, "target_modules", "exclude_modules")


class CriticConfig(_Section):
    """PPO's value model (verl's ``critic``), used when ``algorithm.adv_estimator = "gae"``.

    A causal-LM body with a scalar value head, trained by the learner each step on the
    step's own GAE returns with the clipped value loss (``cliprange_value``); mini-batches
    follow the actor's.
    """

    model: CriticModelConfig = msgspec.field(default_factory=CriticModelConfig)
    optim: OptimConfig = msgspec.field(default_factory=lambda: OptimConfig(lr=1e-5))
    cliprange_value: PositiveFloat = 0.5
    loss_agg_mode: LossAggMode = "token-mean"
    grad_clip: PositiveFloat = 1.0
    ppo_epochs: Positive = 1


class PrmModelConfig(_Section):
    """The reward model's weights (``reward_model.model``). With ``algorithm.adv_estimator =
    "prime"``: PRIME's implicit PRM (empty ``path`` initialises it from the policy
    checkpoint; ``beta_train``, ``update``, ``optim`` train it). With ``reward_model.enable``:
    the discriminative reward model at ``path`` (``relay.generators.reward_model``);
    ``input_tokenizer`` non-empty (verl sets it to the policy's path) re-renders the chat
    with the reward model's own tokenizer and chat template, empty scores the policy's own
    token ids; ``trust_remote_code`` as for ``model``."""

    path: str = ""
    input_tokenizer: str = ""
    trust_remote_code: bool = False
    beta_train: PositiveFloat = 0.05
    update: Literal["before", "after"] = "before"
    optim: OptimConfig = msgspec.field(default_factory=lambda: OptimConfig(lr=1e-6))


class OverlongBufferConfig(_Section):
    """DAPO's soft overlong punishment (verl's ``reward_model.overlong_buffer``): a response
    longer than ``rollout.response_length - len`` tokens loses up to ``penalty_factor``
    reward, linearly over the last ``len`` tokens (``relay.algorithms.reward_shaping``). Applied by
    the generators, so the buffer's filters and the learner see the shaped reward; each
    sample's ``reward_info["overlong_reward"]`` holds its penalty."""

    enable: bool = False
    len: NonNegative = 0
    penalty_factor: NonNegativeFloat = 1.0


RewardCombine = Literal["replace", "add"]  # reward_model.combine
DEFAULT_JUDGE_PROMPT = (
    "Grade the response to the problem. Reply with a single number from 0 (wrong) to 1 "
    "(correct), last.\n\nProblem:\n{prompt}\n\nReference answer: {ground_truth}\n\n"
    "Response:\n{response}\n\nGrade:")


class JudgeConfig(_Section):
    """A generative reward model, an LLM as judge (*Relay*; ``relay.generators.judge``).

    ``enable``: each generator asks the judge about every response with ``prompt_template``
    (fields ``{prompt}``, ``{response}``, ``{ground_truth}``) and takes the LAST number of
    its answer, clipped to [0, 1], as the judge score (no number, a failure or a timeout:
    0 with the reason as the sample's reward error), combined with the rule reward as
    ``reward_model.combine`` says and kept as ``reward_info["judge_score"]``. The judge is
    ``model`` (a model folder) served by ``engine`` (any of Relay's engines: lean, torch,
    hf, vllm, sglang) in the generator, on its device, or in the topology's
    ``[[reward_models]]`` processes when it has any (a vLLM judge beside a vLLM generator
    must be: two vLLM engines do not share a process), greedy and at most
    ``max_new_tokens``, a judge prompt over ``max_prompt_length`` tokens scored 0 with that
    error; or ``url``, an OpenAI-compatible base URL
    (``http://host:8000/v1``: ``POST {url}/chat/completions``, the request's model
    ``model_name``, one request per response within ``timeout_s``). Exactly one of
    ``model`` and ``url``.
    """

    enable: bool = False
    model: str = ""
    engine: Literal["lean", "torch", "hf", "vllm", "sglang"] = "lean"
    url: str = ""
    model_name: str = ""
    prompt_template: str = DEFAULT_JUDGE_PROMPT
    max_new_tokens: Positive = 32
    max_prompt_length: Positive = 1024
    timeout_s: PositiveFloat = 30.0

    def template_problem(self) -> str:
        """What is wrong with ``prompt_template`` ("" when nothing is)."""
        try:
            self.prompt_template.format(prompt="", response="", ground_truth="")
        except (KeyError, IndexError, ValueError) as exc:
            return (f"{exc!r}: its fields are {{prompt}}, {{response}} and {{ground_truth}} "
                    "(double any other brace)")
        return ""


class RewardModelConfig(_Section):
    """A learned reward model, one of two kinds by the advantage estimator.

    - ``algorithm.adv_estimator = "prime"``: ``model`` is PRIME's implicit process reward
      model (verl's PRIME recipe ``reward_model``): a causal LM trained each step on the
      batch's outcome rewards (labels in [0, 1]) with the cross-entropy of
      ``beta_train * sum_t log(pi_phi / pi_ref)``, before (``update = "before"``) or after it
      scores the batch; ``relay.learner.implicit_prm``. ``enable`` may be on or off (verl's
      recipe sets it); the discriminative keys below have no effect.
    - any other estimator with ``enable = true`` (verl's ``reward_model.enable``): a
      discriminative reward model at ``model.path`` scores every sample in the generators,
      or in the topology's ``[[reward_models]]`` processes when it has any
      (``relay.generators.reward_model``), ``micro_batch_size_per_gpu`` sequences per
      forward, sequences over ``max_length`` tokens cut on the right (0: no cut), in
      ``dtype`` on ``device`` (*Relay*; empty: the generator's or reward server's own
      device). ``combine``
      (*Relay*) says how its score ``s_rm`` meets the rule reward ``r_rule`` (the custom
      function's, or the built-in rule's): ``replace`` (verl's reward managers return the
      RM's scores when there are any) gives ``s_rm``, ``add`` gives ``r_rule + s_rm``; each
      sample's ``reward_info`` holds ``rm_score`` and ``rule_score`` either way, and DAPO's
      overlong penalty is added after. Held-out evaluation scores the rule reward only (as
      verl validates).
    - ``judge``: an LLM as judge instead of (never beside) the discriminative model
      (``JudgeConfig``), combined the same way.

    ``overlong_buffer``: DAPO's length penalty on every reward.
    """

    enable: bool = False
    model: PrmModelConfig = msgspec.field(default_factory=PrmModelConfig)
    micro_batch_size_per_gpu: Positive = 8
    max_length: NonNegative = 0
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = ""
    combine: RewardCombine = "replace"
    judge: JudgeConfig = msgspec.field(default_factory=JudgeConfig)
    grad_clip: PositiveFloat = 10.0
    overlong_buffer: OverlongBufferConfig = msgspec.field(default_factory=OverlongBufferConfig)


class FilterGroupsConfig(_Section):
    """DAPO dynamic sampling (verl's ``algorithm.filter_groups``, accepted as another name).

    A group whose samples all score the same on ``metric`` (``score``: the reward; any
    other name: that entry of each sample's ``reward_info``) is dropped and replaced by a
    new generation. ``max_num_gen_batches`` caps the generation per learner batch at that
    many batches' worth of groups; past it the run fails with an error (0: no cap).
    """

    enable: bool = False
    metric: Annotated[str, msgspec.Meta(min_length=1)] = "score"
    max_num_gen_batches: NonNegative = 0


class PfPpoConfig(_Section):
    """PF-PPO policy filtration per prompt group (Shen et al. 2025; ``relay.buffer.pf_ppo``).

    ``mode`` says which samples of each group are kept, ranked by reward: ``best`` (best of
    n), ``best_random`` (the best and one other drawn at random, seeded by ``seed`` and the
    group's rollout id), ``best_worst`` (the best and the worst).
    """

    enable: bool = False
    mode: PfPpoMode = "best_worst"
    seed: int = 0


class ReplayConfig(_Section):
    """How the buffer serves stored groups to the learner (*Relay*; ``relay.buffer.prioritized``).

    ``priority = "fifo"`` (the default) serves groups in arrival order, each once. Any
    other value draws groups by priority ``p`` with probability proportional to
    ``(p + epsilon)^alpha`` (``uniform``: all equal; ``advantage``: mean |reward - group
    mean|; ``pass_rate``: 4 q (1 - q) with q the fraction of samples whose reward is >=
    ``pass_threshold``; ``td_error``: mean |GAE return - value| reported by the learner,
    needs ``algorithm.adv_estimator = "gae"``), weights each group's loss by the
    importance weight ``(N P)^-beta``, over the largest among the batch's groups with
    priority > 0 and at most 1, with beta annealed linearly from ``beta`` at the start to
    ``beta_final`` at the last step (``relay.buffer.prioritized``; 1 undoes the draws' bias fully,
    as Schaul et al. 2016 end; set both equal for a constant beta), trains on a group at
    most ``max_reuse`` times and evicts it once its staleness exceeds ``max_age`` versions
    (-1: ``buffer.max_staleness``; never more).
    """

    priority: ReplayPriority = "fifo"
    alpha: NonNegativeFloat = 0.6
    beta: Fraction = 0.4
    beta_final: Fraction = 1.0  # Relay: beta at the last step, annealed linearly from beta
    epsilon: PositiveFloat = 1e-3
    max_reuse: Positive = 1
    max_age: Annotated[int, msgspec.Meta(ge=-1)] = -1
    pass_threshold: float = 0.5
    seed: int = 0


class BufferConfig(_Section):
    """The hub's policies. ``max_staleness`` is eta: samples more than eta versions behind the
    learner are never leased for nor trained on; eta = 0 is synchronous on-policy training.
    ``filter_groups`` and ``pf_ppo`` are the replay filters (``relay.buffer.store.FilteredStore``):
    dynamic sampling judges each whole group first, then PF-PPO picks the samples of those
    kept; ``replay`` says how the kept groups are served. The rollout log gets every sound
    group whole, before the filters.

    The hub refuses a group whose token ids fall outside the model's vocabulary:
    ``vocab_size`` (0: the ``vocab_size`` of ``model.path``'s ``config.json``; set it when
    the buffer's host has no copy of the model). ``max_message_bytes`` bounds every frame a
    peer sends the buffer (ZeroMQ's ``MAXMSGSIZE``: a larger frame drops the sender's
    connection before it is read, and the buffer logs the drop); a rollout group's largest
    frame is one tensor of a response or the group's texts and small tensors.

    ``client_patience_s`` (Relay): how long the generators and the learner keep asking a
    buffer that does not answer (a stall) before they give up (``relay.transport.retry``).

    ``rollout_log_max_gb`` (Relay): at each checkpoint, while the rollout log's segments
    hold more than this many GB (1e9 bytes), the oldest that no kept checkpoint's replay can
    read are deleted (``relay.buffer.rollout_log``: older than the oldest kept checkpoint by more
    than ``max_staleness`` versions); what is still over is logged once. 0: no cap. A replay
    from the start of the run (no checkpoint) then lacks the deleted groups.

    ``min_generators`` (Relay): no prompt is leased before this many generators have
    attached at once; after that the run goes on with whoever is attached. It keeps a fast
    engine from running the first steps alone while a slower one starts (vLLM takes ~15 s
    on a CPU); 0 or 1: the first generator starts the run.

    ``weights_timeout_s`` (Relay): how long a generator holds a lease whose weights
    (``min_version``) have not arrived before it returns the prompts; 0: ``lease_timeout_s``.
    It may not exceed ``lease_timeout_s``: an idle generator's lease is renewed only while
    the learner has not published the version it waits for (``relay.buffer.leases``), so past
    ``lease_timeout_s`` the buffer has already expired and re-leased it."""

    max_staleness: NonNegative = 1
    lease_timeout_s: PositiveFloat = 120.0
    heartbeat_timeout_s: PositiveFloat = 30.0
    rollout_log: bool = True  # Relay: append every group received to run_dir/rollouts/
    rollout_log_max_gb: NonNegativeFloat = 0.0  # Relay: the log's segments, at most; 0: no cap
    vocab_size: NonNegative = 0  # Relay: token ids must be below it; 0: the model's
    max_message_bytes: Annotated[int, msgspec.Meta(ge=1 << 16)] = 64 << 20  # Relay
    client_patience_s: PositiveFloat = 300.0  # Relay: retrying a silent buffer, at most
    weights_timeout_s: NonNegativeFloat = 0.0  # Relay: a lease's wait for weights; 0: lease's
    min_generators: NonNegative = 0  # Relay: generators attached before the first lease
    filter_groups: FilterGroupsConfig = msgspec.field(default_factory=FilterGroupsConfig)
    pf_ppo: PfPpoConfig = msgspec.field(default_factory=PfPpoConfig)
    replay: ReplayConfig = msgspec.field(default_factory=ReplayConfig)


class TrainerConfig(_Section):
    """The run's length and cadence. ``test_freq``/``save_freq`` of -1 turn them off.

    Length, as in verl: ``total_training_steps`` learner steps when set, else
    ``total_epochs`` passes over the training rows (``total_epochs x (rows //
    data.train_batch_size)`` steps, the rows ``data.filter_overlong_prompts`` keeps, as verl
    counts them), else 100 steps. ``relay.configs.checks`` resolves it, so a loaded config always
    has ``total_training_steps``.

    ``resume_mode`` (verl's): ``auto`` continues from the newest complete checkpoint in the
    checkpoint dir (``checkpoint.dir``) if there is one and starts afresh otherwise;
    ``disable`` always starts afresh; ``resume_path`` continues from the checkpoint folder
    ``resume_from_path`` (a ``step-<N>`` folder). The launcher resolves ``auto`` before
    anything starts, so the run directory's ``run.toml`` says ``resume_path`` (with the
    folder) or ``disable``; ``tools/launch-cluster.py --resume RUN_DIR`` is ``auto`` on a
    run directory. A resumed run continues at the checkpoint's step + 1 with its weight
    version (``relay.learner.checkpoint``).

    ``resume_allow_changes`` (Relay): the buffer's saved state means something only under
    the config that wrote it (``relay.buffer.fingerprint``: the training rows, ``data.seed``,
    ``data.shuffle``, ``data.train_batch_size``, ``rollout.n``, ``model.path``), so the
    launcher refuses a resume that changes one of them, naming it, unless it is listed
    here: ``trainer.resume_allow_changes=data.train_batch_size``, or a TOML list for
    several. It applies to the launch that names it (``--resume`` does not carry it over).
    """

    total_training_steps: Positive | None = None
    total_epochs: Positive | None = None
    test_freq: int = 10
    save_freq: int = -1
    publish_every: Positive = 1  # Relay: publish weights to generators every k steps
    val_before_train: bool = True
    log_freq: Positive = 10  # Relay: a metrics line in the learner's log every this many steps
    log_val_generations: NonNegative = 0  # held-out responses logged per evaluation (a table)
    # every held-out response of an evaluation as <dir>/<step>.jsonl, written on the
    # evaluator's host (verl's dump; relay.generators.held_out.write_generations); "": none
    validation_data_dir: str = ""
    # each training step's samples as <dir>/<step>.jsonl, written by the buffer when it
    # serves the step (verl's dump; relay.buffer.rollout_dump); "": none
    rollout_data_dir: str = ""
    critic_warmup: NonNegative = 0  # steps that train only the critic (adv_estimator = gae)
    # Relay: published versions that may wait for a busy evaluator, each a CPU copy of the
    # weights on learner rank 0; past it the oldest waiting one is not evaluated
    max_waiting_evals: Positive = 2
    seed: int = 0
    run_dir: str = "runs"  # Relay: each run writes to run_dir/<experiment>-<time>/
    # Relay: the launcher ends a run that makes no learner step for this long, naming the
    # stage that holds it up (relay.launcher.watchdog); 0: never
    progress_timeout_s: NonNegativeFloat = 3600.0
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: str = ""  # the checkpoint folder of resume_mode = "resume_path"
    resume_allow_changes: FingerprintKey | list[FingerprintKey] = msgspec.field(
        default_factory=list)

    @property
    def allowed_resume_changes(self) -> frozenset[str]:
        """``resume_allow_changes`` as a set of keys (one key, or a list of them)."""
        allowed = self.resume_allow_changes
        return frozenset([allowed] if isinstance(allowed, str) else allowed)


TrackerName = Literal["console", "mlflow", "wandb", "tensorboard", "swanlab"]


class TrackingConfig(_Section):
    """Where the learner's metrics go (``relay.learner.tracking``).

    MLflow always: resuming and the offline replay find the run in it. An empty ``uri``
    means a local store under the run directory; ``experiment`` and ``run_name`` (empty:
    the run directory's name) name the experiment and the run. ``loggers`` (verl's
    ``trainer.logger``) adds ``wandb`` (project ``experiment``, run ``run_name``; its files
    under run_dir/wandb; ``wandb_mode = "offline"`` by default, since ``online`` needs the
    network and a login), ``tensorboard`` (event files under run_dir/tensorboard) and
    ``swanlab`` (project ``experiment``, run ``run_name``; always offline, its files under
    run_dir/swanlog for ``swanlab sync``); ``console`` and ``mlflow`` are always on (the
    launcher's status line, and the store above).
    """

    uri: str = ""
    experiment: str = "relay"
    run_name: str = ""
    loggers: list[TrackerName] = msgspec.field(default_factory=lambda: ["console", "mlflow"])
    wandb_mode: Literal["offline", "online"] = "offline"


class CheckpointConfig(_Section):
    """Where ``trainer.save_freq`` checkpoints go (empty: run_dir/checkpoints)."""

    dir: str = ""
    keep_last: Positive = 2


class RunConfig(_Section):
    """The whole of a run config."""

    data: DataConfig
    model: ModelConfig
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    actor: ActorConfig = msgspec.field(default_factory=ActorConfig)
    ref: RefConfig = msgspec.field(default_factory=RefConfig)
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    critic: CriticConfig = msgspec.field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = msgspec.field(default_factory=RewardModelConfig)
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    tracking: TrackingConfig = msgspec.field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    custom_reward_function: RewardConfig = msgspec.field(default_factory=RewardConfig)
    sandbox: SandboxSettings = msgspec.field(default_factory=SandboxSettings)  # Relay's

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates held-out data: validation files, and a cadence
        (``trainer.test_freq`` or ``trainer.val_before_train``)."""
        return bool(self.data.val_files) and (self.trainer.test_freq > 0
                                              or self.trainer.val_before_train)

    @property
    def learner_model_paths(self) -> set[str]:
        """The models the learner loads: the policy (and its reference), the critic with
        ``gae``, the implicit PRM with ``prime`` (each defaulting to ``model.path``)."""
        paths = {self.model.path}
        estimator = self.algorithm.estimator
        if estimator.critic:
            paths.add(self.critic.model.path or self.model.path)
        if estimator.prm:
            paths.add(self.reward_model.model.path or self.model.path)
        return paths
