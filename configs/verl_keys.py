"""verl's config keys in a Relay run config: every key of verl's ``ppo_trainer.yaml`` in one
of four groups, defined once in ``TABLE``.

- **same**: Relay has the key, under the same path (after the short section names below), and
  it means what it means in verl.
- **differs**: accepted, with a documented difference. Either Relay has the key and its
  meaning or default differs (the note says how), or Relay has no such key and the setting
  has no effect here (the note says why); such a key may accept only the values that make no
  difference (``accept``), and refuses the others with the note.
- **mapped**: stands for another Relay key (``to``): a run-config key, or a placement that
  Relay keeps in the topology (``topology.`` keys, applied by ``apply_placement``).
- **refused**: an error whose message names what to use instead, and why.

verl's long section names are Relay's short ones (``VERL_PREFIXES``):
``actor_rollout_ref.actor.X`` is ``actor.X``, ``.rollout.X`` is ``rollout.X``, ``.model.X``
is ``model.X`` and ``.ref.X`` is ``ref.X``; both spellings work in files and on the command
line. ``VerlKeys`` is the translator ``relay.configs.loader`` calls for a key the run schema lacks;
it records what it did (``notes``) for the launcher to print, and the placement keys
(``placement``) for the launcher to apply to the topology. ``markdown_table`` renders
``TABLE`` for ``configs/verl-keys.md`` (``tools/gen-verl-docs.py``).

The key list the table is checked against (``tests/configs/verl_ppo_trainer_keys.txt``) is
verl v0.5.0's ``verl/trainer/config/_generated_ppo_trainer.yaml``, flattened.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import msgspec

from relay.configs.loader import ConfigError, KeyPath, format_key, parse_key, type_at
from relay.configs.run_schema import VERL_ALIASES, RunConfig
from relay.configs.topology_schema import (EngineName, EvaluatorPlacement, GeneratorPlacement,
                                           LeanOptions, SGLangOptions, Topology, VLLMOptions)

Group = Literal["same", "differs", "mapped", "refused"]
GROUP_TITLES: dict[Group, str] = {
    "same": "works the same",
    "differs": "works with a documented difference",
    "mapped": "mapped to its Relay equivalent",
    "refused": "refused",
}
VERL_PREFIXES: dict[KeyPath, KeyPath] = {
    long: short for long, short in VERL_ALIASES.items() if long[0] == "actor_rollout_ref"}
TOPOLOGY = "topology."  # a ``to`` key with this prefix is a placement


class VerlKey(msgspec.Struct, frozen=True, kw_only=True):
    """One of verl's keys (``key``, as verl spells it; a trailing ``.*`` covers every key
    below it) and what Relay does with it (module docstring)."""

    key: str
    group: Group
    note: str = ""
    to: tuple[str, ...] = ()  # mapped: the Relay keys it sets
    accept: tuple[Any, ...] | None = None  # differs, no Relay key: the values accepted

    @property
    def short(self) -> KeyPath:
        """The key path in Relay's short section names (``.*`` dropped)."""
        return shorten(parse_key(self.key.removesuffix(".*")))  # type: ignore[arg-type]

    @property
    def subtree(self) -> bool:
        return self.key.endswith(".*")


def in_schema(parts: KeyPath) -> bool:
    """Whether the run schema has this key path."""
    try:
        type_at(RunConfig, parts)
    except KeyError:
        return False
    return True


def shorten(parts: KeyPath) -> KeyPath:
    """verl's long section names to Relay's short ones (``VERL_PREFIXES``)."""
    for long, short in VERL_PREFIXES.items():
        if parts[:len(long)] == long:
            return short + parts[len(long):]
    return parts


A, R, M, F = ("actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.model",
              "actor_rollout_ref.ref")
ROLLOUT_NAME = f"{R}.name"  # the engine of every generator and of the evaluator


def _same(*keys: str) -> list[VerlKey]:
    return [VerlKey(key=k, group="same") for k in keys]


def _inert(note: str, *keys: str, accept: tuple[Any, ...] | None = None) -> list[VerlKey]:
    return [VerlKey(key=k, group="differs", note=note, accept=accept) for k in keys]


def _refused(note: str, *keys: str) -> list[VerlKey]:
    return [VerlKey(key=k, group="refused", note=note) for k in keys]


_FSDP = ("Relay shards this model with FSDP2 (actor.strategy = \"deepspeed\" puts the policy "
         "alone in a DeepSpeed engine; Megatron is not supported); no effect")
_NO_COMPILE = ("the frozen reference is not compiled (actor.use_torch_compile compiles the "
               "policy's norms and MLPs); no effect")
_ENTROPY_MEM = ("a verl memory saving for the entropy; Relay computes the entropy per pass "
                "only where the loss or the logs use it; no effect")
_WRAP = ("FSDP2 shards each transformer block as one unit (relay.learner.model); verl's wrap "
         "policy, prefetch and resharding knobs have no effect")
_PROFILER = "Relay has no built-in profiler (use torch.profiler around a process); no effect"
ENGINE_KNOBS = ("gpu_memory_utilization", "tensor_model_parallel_size", "enforce_eager",
                "enable_chunked_prefill", "max_num_batched_tokens", "max_model_len")
"""verl's vLLM/SGLang engine knobs (``rollout.X``) that set both engines' topology sections."""
LEAN_KNOBS = ("gpu_memory_utilization", "max_num_batched_tokens")
"""The engine knobs that also set the lean engine's section (``LeanOptions``)."""


def _knob_sections(name: str) -> tuple[str, ...]:
    """The engine sections of a placement one of ``ENGINE_KNOBS`` sets."""
    return ("lean", "vllm", "sglang") if name in LEAN_KNOBS else ("vllm", "sglang")


_ENGINE_KNOB = ("set in the vllm and sglang sections of every generator and of the evaluator "
                "(configs/topology_schema.py: VLLMOptions, SGLangOptions); a section matters "
                "only where its engine runs; null keeps Relay's default")
_LEAN_KNOB = ("set in the lean, vllm and sglang sections of every generator and of the "
              "evaluator (configs/topology_schema.py: LeanOptions, VLLMOptions, SGLangOptions); "
              "a section matters only where its engine runs; null keeps Relay's default")
_ENGINE_KWARGS = ("the engine's extra arguments, by name (engine_kwargs.vllm.swap_space=4 is "
                  "swap_space), in that engine's section of every generator and of the "
                  "evaluator; null drops the argument, as in verl")
_COLOCATED = ("verl's colocated mode (generation sharing the learner's GPUs: cache freeing, "
              "wake-up, dummy weight loading, layered summoning); Relay's generators are "
              "separate processes that load model.path and keep their engine; no effect")
_LOGPROB = ("generators return the behavior log-prob of every token they sample; the "
            "learner recomputes proximal log-probs with the actor's passes; no effect")
_MULTI_TURN = ("the multi-turn loop renders each episode with the model's own chat template "
               "and never re-tokenizes the policy's tokens (relay.configs.chat_turns); no "
               "effect")
_NO_RAY = ("verl's own Ray workers' setting; Relay's Ray backend (launcher.backend = ray, "
           "[launcher.ray]) has no such knob; no effect")
_DEPRECATED = ("verl's deprecated global micro-batch size; give the per-GPU size "
               "{}_per_gpu instead (a micro-batch size per rank is what the learner cuts)")
_RM_ONLY = ("the reward model runs with transformers inside each generator, one forward per "
            "micro-batch of reward_model.micro_batch_size_per_gpu sequences; no effect")
_REWARD_SECTION = ("verl's newer reward section, the same setting as its older key")
_RM_PLACED = ("the reward functions run in each generator's reward worker and the reward "
              "model in each generator, on its device (reward_model.device); verl's worker "
              "counts, pools and inference engine for it have no effect")
_CRITIC_CUT = ("the critic's passes are cut like the actor's (actor.ppo_micro_batch_size_per_gpu"
               ", actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu) and its mini-batches "
               "follow the actor's; no effect")
_CKPT = ("a Relay checkpoint always holds the model, the optimizer, the run's state (the "
         "buffer's prompt stream included) and the policy in Hugging Face format (hf/); "
         "no effect")

TABLE: tuple[VerlKey, ...] = tuple([
    # ---- actor_rollout_ref.actor ------------------------------------------------------
    *_same(f"{A}.strategy"),  # fsdp, fsdp2, and Relay's deepspeed (megatron is refused)
    *_same(f"{A}.ppo_mini_batch_size", f"{A}.ppo_micro_batch_size_per_gpu",
           f"{A}.use_dynamic_bsz", f"{A}.ppo_max_token_len_per_gpu", f"{A}.clip_ratio_low",
           f"{A}.clip_ratio_high", f"{A}.policy_loss.loss_mode", f"{A}.policy_loss.clip_cov_ratio",
           f"{A}.policy_loss.clip_cov_lb", f"{A}.policy_loss.clip_cov_ub",
           f"{A}.policy_loss.kl_cov_ratio", f"{A}.policy_loss.ppo_kl_coef", f"{A}.clip_ratio_c",
           f"{A}.loss_agg_mode", f"{A}.entropy_coeff", f"{A}.use_kl_loss", f"{A}.kl_loss_coef",
           f"{A}.kl_loss_type", f"{A}.ppo_epochs", f"{A}.optim.lr",
           f"{A}.optim.lr_warmup_steps_ratio", f"{A}.optim.weight_decay",
           f"{A}.optim.lr_warmup_steps", f"{A}.optim.min_lr_ratio", f"{A}.optim.warmup_style",
           f"{A}.grad_clip", f"{A}.ulysses_sequence_parallel_size",
           f"{A}.fsdp_config.param_offload", f"{A}.fsdp_config.optimizer_offload",
           f"{A}.fsdp_config.fsdp_size"),
    *_refused(_DEPRECATED.format("actor_rollout_ref.actor.ppo_micro_batch_size"),
              f"{A}.ppo_micro_batch_size"),
    VerlKey(key=f"{A}.clip_ratio", group="mapped", to=("actor.clip_ratio_low",
                                                       "actor.clip_ratio_high"),
            note="verl's default for both clip bounds; sets each one not set explicitly"),
    *_same(f"{A}.use_torch_compile"),
    *_inert("Relay's mini-batches are whole prompt groups in order (relay.learner.micro_batches); "
            "only false", f"{A}.shuffle", accept=(False,)),
    *_inert(_CKPT, f"{A}.checkpoint.save_contents", f"{A}.checkpoint.load_contents"),
    *_inert("set by the trainer from trainer.total_training_steps, in Relay too; no effect",
            f"{A}.optim.total_training_steps"),
    *_inert("Relay's cosine schedule is half a cycle (relay.learner.optim); only 0.5",
            f"{A}.optim.num_cycles", accept=(0.5,)),
    *_inert(_ENTROPY_MEM, f"{A}.entropy_from_logits_with_chunking", f"{A}.entropy_checkpointing"),
    *_inert(_WRAP, f"{A}.fsdp_config.wrap_policy.min_num_params",
            f"{A}.fsdp_config.reshard_after_forward", f"{A}.fsdp_config.forward_prefetch"),
    *_inert("param_offload already uses FSDP2's CPUOffloadPolicy; no effect",
            f"{A}.fsdp_config.offload_policy"),
    # ---- actor_rollout_ref.ref ---------------------------------------------------------
    *_inert(_FSDP, f"{F}.strategy", accept=("fsdp", "fsdp2")),
    *_inert(_NO_COMPILE, f"{F}.use_torch_compile"),
    *_refused(_DEPRECATED.format("actor_rollout_ref.ref.log_prob_micro_batch_size"),
              f"{F}.log_prob_micro_batch_size"),
    *_same(f"{F}.log_prob_micro_batch_size_per_gpu", f"{F}.log_prob_use_dynamic_bsz",
           f"{F}.log_prob_max_token_len_per_gpu", f"{F}.fsdp_config.param_offload",
           f"{F}.fsdp_config.fsdp_size"),
    VerlKey(key=f"{F}.ulysses_sequence_parallel_size", group="differs",
            note="must equal actor.ulysses_sequence_parallel_size: every model of Relay's "
                 "learner runs on one sequence-parallel mesh"),
    *_inert(_WRAP, f"{F}.fsdp_config.reshard_after_forward", f"{F}.fsdp_config.forward_prefetch",
            f"{F}.fsdp_config.wrap_policy.min_num_params"),
    *_inert(_ENTROPY_MEM, f"{F}.entropy_from_logits_with_chunking", f"{F}.entropy_checkpointing"),
    # ---- actor_rollout_ref.rollout -----------------------------------------------------
    VerlKey(key=ROLLOUT_NAME, group="mapped", to=("topology.generators[*].engine",
                                                 "topology.evaluator.engine"),
            note="the engine of every generator and of the evaluator: vllm, sglang, or Relay's "
                 "own lean, torch and hf; Relay places them one per device in "
                 "topology.generators (not colocated with the learner)"),
    *_inert("Relay's generators always run apart from the learner, asynchronously; no effect",
            f"{R}.mode", accept=("sync", "async")),
    *_same(f"{R}.temperature", f"{R}.top_k", f"{R}.top_p", f"{R}.response_length",
           f"{R}.max_num_seqs", f"{R}.n", f"{R}.val_kwargs.top_k", f"{R}.val_kwargs.top_p",
           f"{R}.val_kwargs.temperature", f"{R}.val_kwargs.n",
           f"{R}.update_weights_bucket_megabytes"),
    VerlKey(key=f"{R}.val_kwargs.do_sample", group="differs",
            note="false decodes greedily whatever the temperature, as in verl; Relay's default "
                 "is true (verl's false), since a temperature of 0 already means greedy"),
    VerlKey(key=f"{R}.prompt_length", group="mapped", to=("data.max_prompt_length",),
            note="verl interpolates it from data.max_prompt_length; one key in Relay"),
    *_inert("generators decode in model.dtype; no effect", f"{R}.dtype"),
    *[VerlKey(key=f"{R}.{name}", group="mapped",
              note=_LEAN_KNOB if name in LEAN_KNOBS else _ENGINE_KNOB, to=tuple(
        f"topology.{at}.{engine}.{name}" for at in ("generators[*]", "evaluator")
        for engine in _knob_sections(name))) for name in ENGINE_KNOBS],
    *[VerlKey(key=f"{R}.engine_kwargs.{engine}.*", group="mapped", note=_ENGINE_KWARGS,
              to=tuple(f"topology.{at}.{engine}.engine_kwargs"
                       for at in ("generators[*]", "evaluator"))) for engine in ("vllm", "sglang")],
    *_inert(_COLOCATED, f"{R}.free_cache_engine", f"{R}.multi_stage_wake_up",
            f"{R}.load_format", f"{R}.layered_summon"),
    *_inert("generators stream each finished group to the buffer, so no batch waits for its "
            "slowest rollouts and none is over-sampled to be aborted (verl >= 0.6); no effect",
            f"{R}.over_sample_rate"),
    *_inert("Relay's vLLM engine leaves it to vllm.LLM; engine_kwargs.vllm.disable_log_stats "
            "sets it; no effect", f"{R}.disable_log_stats"),
    *_inert("generators stop at EOS; only false", f"{R}.ignore_eos", accept=(False,)),
    *_inert(_LOGPROB, f"{R}.log_prob_micro_batch_size", f"{R}.log_prob_micro_batch_size_per_gpu",
            f"{R}.log_prob_use_dynamic_bsz", f"{R}.log_prob_max_token_len_per_gpu",
            f"{R}.calculate_log_probs"),
    *_inert("training rollouts are sampled (greedy decoding is for evaluation: "
            "rollout.val_kwargs.do_sample); only true", f"{R}.do_sample", accept=(True,)),
    *_same(f"{R}.multi_turn.enable", f"{R}.multi_turn.max_assistant_turns",
           f"{R}.multi_turn.tool_config_path", f"{R}.multi_turn.max_user_turns",
           f"{R}.multi_turn.max_parallel_calls", f"{R}.multi_turn.max_tool_response_length",
           f"{R}.multi_turn.tool_response_truncate_side", f"{R}.multi_turn.format",
           f"{R}.multi_turn.interaction_config_path"),
    *_inert(_MULTI_TURN, f"{R}.multi_turn.completion_callback",
            f"{R}.multi_turn.use_inference_chat_template",
            f"{R}.multi_turn.tokenization_sanity_check_mode"),
    *_inert("each generator process runs its own rollout loop; no effect",
            f"{R}.agent.num_workers"),
    *_inert("agent loops are not supported yet; only null", f"{R}.agent.agent_loop_config_path",
            f"{R}.agent.custom_async_server.path", f"{R}.agent.custom_async_server.name",
            accept=(None,)),
    *_inert("rollout tracing is not supported yet; only null", f"{R}.trace.backend",
            accept=(None,)),
    *_inert("rollout tracing is not supported yet; no effect", f"{R}.trace.token2text"),
    *_inert("Relay never colocates generation with training: generators and the learner are "
            "separate processes with their own devices; no effect",
            "actor_rollout_ref.hybrid_engine"),
    # ---- actor_rollout_ref.model -------------------------------------------------------
    *_same(f"{M}.path", f"{M}.enable_gradient_checkpointing", f"{M}.trust_remote_code"),
    *_inert("a custom chat template is not supported yet: save it as the tokenizer's "
            "chat_template in the model folder; only null", f"{M}.custom_chat_template",
            accept=(None,)),
    *_inert("models (and LoRA adapters) load from a local folder; no effect", f"{M}.use_shm"),
    *_inert("importing extra model code is not supported yet (use trust_remote_code with a "
            "model folder that carries its code); only null", f"{M}.external_lib",
            accept=(None,)),
    *_inert("overriding the model's config is not supported yet: edit config.json in a copy of "
            "the model folder; only {}", f"{M}.override_config.*", accept=({},)),
    *_inert("activation offload is not supported yet (use "
            "actor_rollout_ref.model.enable_gradient_checkpointing); only false",
            f"{M}.enable_activation_offload", accept=(False,)),
    *_inert("Relay's passes never compute padding tokens' attention: rows are sorted by length "
            "into passes, packed without padding under Ulysses; no effect",
            f"{M}.use_remove_padding"),
    *_same(f"{M}.lora_rank", f"{M}.lora_alpha", f"{M}.target_modules", f"{M}.exclude_modules"),
    *_inert("Liger kernels are not supported yet; only false", f"{M}.use_liger", accept=(False,)),
    *_inert("the learner's log-probs are computed in fp32 from the model's logits; no effect",
            f"{M}.use_fused_kernels", f"{M}.fused_kernel_options.impl_backend"),
    *_inert(_PROFILER, "actor_rollout_ref.profiler.*"),
    # ---- trainer -----------------------------------------------------------------------
    *_inert(_PROFILER, "trainer.npu_profile.*", "trainer.controller_nsight_options.*",
            "trainer.worker_nsight_options.*"),
    *_inert(_PROFILER.replace("no effect", "only null"), "trainer.profile_steps", accept=(None,)),
    *_inert(_PROFILER + " (verl >= 0.6's global_profiler section)", "global_profiler.*"),
    *_inert("each learner rank's passes are balanced by length (relay.learner.micro_batches); "
            "no effect", "trainer.balance_batch"),
    VerlKey(key="trainer.total_epochs", group="differs",
            note="trainer.total_training_steps, when set, overrides it, as in verl; an epoch "
                 "is rows // data.train_batch_size steps, rows counted after "
                 "data.filter_overlong_prompts as in verl; unset with both unset: 100 steps "
                 "(verl's default is 30 epochs)"),
    VerlKey(key="trainer.total_training_steps", group="same",
            note="unset (verl's null): trainer.total_epochs passes over data.train_files"),
    VerlKey(key="trainer.project_name", group="mapped", to=("tracking.experiment",),
            note="the MLflow experiment"),
    VerlKey(key="trainer.experiment_name", group="mapped", to=("tracking.run_name",),
            note="the MLflow run's name (and the run directory's)"),
    VerlKey(key="trainer.logger", group="mapped", to=("tracking.loggers",),
            note="console, mlflow, wandb (offline unless tracking.wandb_mode = online), "
                 "tensorboard and swanlab (always offline: swanlab sync uploads a run); "
                 "console and MLflow are always on (resuming reads the MLflow run)"),
    VerlKey(key="trainer.log_val_generations", group="same",
            note="verl's seeded sample of N held-out responses (sorted by prompt, shuffled "
                 "with seed 42) with their rewards, a table per evaluation in every tracker"),
    VerlKey(key="trainer.rollout_data_dir", group="same",
            note="each training step's samples as DIR/STEP.jsonl (input, output, gts, score, "
                 "step and the reward's extra values), written on the buffer's host when it "
                 "serves the step; null: none (every run directory keeps its binary rollout "
                 "log in rollouts/ besides: relay rollouts RUN_DIR --step N reads it)"),
    VerlKey(key="trainer.validation_data_dir", group="same",
            note="each evaluation's responses as DIR/STEP.jsonl (input, output, gts, "
                 "score, step and the reward's extra values), written on the evaluator's "
                 "host; null: none"),
    VerlKey(key="trainer.nnodes", group="mapped", to=("topology.learner.nnodes",),
            note="the learner's nodes under launcher.backend = ray or slurm, which pick them; "
                 "under local and ssh it must equal the number of learner hosts listed in "
                 "the topology (Relay starts one torchrun per host in learner.hosts)"),
    VerlKey(key="trainer.n_gpus_per_node", group="mapped", to=("topology.learner.nproc_per_node",),
            note="the learner's ranks per host; generators and the evaluator take devices of "
                 "their own, listed in topology.generators (verl shares each GPU between them)"),
    VerlKey(key="trainer.device", group="mapped", to=("topology.learner.device",),
            note="the learner's device (cuda or cpu); each generator names its own device"),
    *_same("trainer.save_freq", "trainer.resume_mode", "trainer.resume_from_path",
           "trainer.val_before_train", "trainer.test_freq", "trainer.critic_warmup"),
    *_inert("an elastic-scheduler knob of verl's; no effect", "trainer.esi_redundant_time"),
    *_inert("evaluating without training is not supported yet; only false", "trainer.val_only",
            accept=(False,)),
    *_inert("copying checkpoints to HDFS is not supported; only null", "trainer.default_hdfs_dir",
            accept=(None,)),
    *_inert("checkpoints stay where they are written; no effect",
            "trainer.del_local_ckpt_after_load"),
    VerlKey(key="trainer.default_local_dir", group="mapped", to=("checkpoint.dir",),
            note="where checkpoints are written"),
    VerlKey(key="trainer.max_actor_ckpt_to_keep", group="mapped", to=("checkpoint.keep_last",),
            note="one Relay checkpoint holds every model; null keeps Relay's default"),
    VerlKey(key="trainer.max_critic_ckpt_to_keep", group="mapped", to=("checkpoint.keep_last",),
            note="one Relay checkpoint holds every model; null keeps Relay's default"),
    VerlKey(key="ray_init.num_cpus", group="mapped", to=("topology.launcher.ray.num_cpus",),
            note="the CPUs of the Ray instance the launcher starts on its own machine "
                 "(launcher.backend = ray with no launcher.ray.address); a running cluster "
                 "keeps its own"),
    *_inert(_NO_RAY, "trainer.ray_wait_register_center_timeout", "ray_init.*"),
    *_inert("Relay has one worker implementation; no effect", "trainer.use_legacy_worker_impl"),
    # ---- data --------------------------------------------------------------------------
    *_inert("the tokenizer is model.path's; only null", "data.tokenizer", accept=(None,)),
    *_inert("data files are read from disk; no effect", "data.use_shm"),
    *_same("data.train_files", "data.val_files", "data.prompt_key", "data.max_prompt_length",
           "data.train_batch_size", "data.shuffle", "data.filter_overlong_prompts"),
    VerlKey(key="data.truncation", group="differs",
            note="error (refused when the data is loaded), left, right or middle; Relay's "
                 "default is left (verl's error)"),
    *_inert("rewards are chosen by each row's data_source; only data_source",
            "data.reward_fn_key", accept=("data_source",)),
    VerlKey(key="data.max_response_length", group="mapped", to=("rollout.response_length",),
            note="verl's rollout.response_length interpolates it; one key in Relay"),
    *_inert("the evaluator decodes up to rollout.max_num_seqs sequences at a time; no effect",
            "data.val_batch_size"),
    *_inert("prompts always travel to the generators as chat messages, which apply the chat "
            "template (verl's return_raw_chat = true); no effect", "data.return_raw_chat",
            "data.return_raw_input_ids", "data.return_full_prompt"),
    *_inert("the buffer reads the data in its own process; no effect",
            "data.dataloader_num_workers", "data.filter_overlong_prompts_workers"),
    *_inert("held-out rows are evaluated in file order; only false", "data.validation_shuffle",
            accept=(False,)),
    *_inert("multi-modal prompts are not supported yet; no effect", "data.image_key",
            "data.video_key", "data.return_multi_modal_inputs"),
    VerlKey(key="data.trust_remote_code", group="mapped", to=("model.trust_remote_code",),
            note="the tokenizer is model.path's, loaded with model.trust_remote_code"),
    *_inert("custom dataset classes, samplers and data generators are not supported yet: "
            "write the data in verl's schema (tools/prepare-data.py); only null",
            "data.custom_cls.path", "data.custom_cls.name", "data.sampler.class_path",
            "data.sampler.class_name", "data.datagen.path", "data.datagen.name", accept=(None,)),
    # ---- critic ------------------------------------------------------------------------
    *_inert("verl copies rollout.n here; no effect", "critic.rollout_n"),
    *_inert(_FSDP, "critic.strategy", accept=("fsdp", "fsdp2")),
    *_same("critic.optim.lr_warmup_steps_ratio", "critic.optim.weight_decay", "critic.optim.lr",
           "critic.optim.min_lr_ratio", "critic.optim.warmup_style", "critic.model.path",
           "critic.ppo_epochs", "critic.cliprange_value", "critic.loss_agg_mode",
           "critic.grad_clip", "critic.model.fsdp_config.fsdp_size"),
    *_inert("set by the trainer from trainer.total_training_steps, in Relay too; no effect",
            "critic.optim.total_training_steps"),
    *_inert("the critic reads the policy's token ids (its vocabulary must match); no effect",
            "critic.model.tokenizer_path"),
    *_inert("overriding the model's config is not supported yet; only {}",
            "critic.model.override_config.*", accept=({},)),
    *_inert("importing extra model code is not supported yet; only null",
            "critic.model.external_lib", accept=(None,)),
    *_inert("the critic loads with model.trust_remote_code, gradient checkpointing with "
            "model.enable_gradient_checkpointing; no effect", "critic.model.trust_remote_code",
            "critic.model.enable_gradient_checkpointing"),
    *_inert("models load from a local folder; no effect", "critic.model.use_shm"),
    *_inert("activation offload is not supported yet; only false",
            "critic.model.enable_activation_offload", accept=(False,)),
    *_inert("see actor_rollout_ref.model.use_remove_padding; no effect",
            "critic.model.use_remove_padding"),
    *_inert("offloading the critic is not supported yet; only false",
            "critic.model.fsdp_config.param_offload", "critic.model.fsdp_config.optimizer_offload",
            accept=(False,)),
    *_inert(_WRAP, "critic.model.fsdp_config.offload_policy",
            "critic.model.fsdp_config.reshard_after_forward",
            "critic.model.fsdp_config.wrap_policy.min_num_params",
            "critic.model.fsdp_config.forward_prefetch"),
    *_same("critic.model.lora_rank", "critic.model.lora_alpha", "critic.model.target_modules",
           "critic.model.exclude_modules"),
    *_inert(_CRITIC_CUT, "critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu",
            "critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu",
            "critic.forward_max_token_len_per_gpu", "critic.forward_micro_batch_size_per_gpu"),
    *_refused(_DEPRECATED.format("critic.ppo_micro_batch_size"), "critic.ppo_micro_batch_size"),
    *_refused(_DEPRECATED.format("critic.forward_micro_batch_size"),
              "critic.forward_micro_batch_size"),
    *_inert("the critic's mini-batches are whole prompt groups in order; only false",
            "critic.shuffle", accept=(False,)),
    *_inert(_CKPT, "critic.checkpoint.save_contents", "critic.checkpoint.load_contents"),
    *_inert(_PROFILER, "critic.profiler.*"),
    *_inert("Hydra's class path; no effect", "critic._target_", "algorithm._target_",
            "algorithm.kl_ctrl._target_", "algorithm.pf_ppo._target_"),
    *_inert("the critic runs on the actor's sequence-parallel mesh "
            "(actor.ulysses_sequence_parallel_size); no effect",
            "critic.ulysses_sequence_parallel_size"),
    # ---- reward_model ------------------------------------------------------------------
    VerlKey(key="reward_model.enable", group="differs",
            note="a discriminative reward model scores every sample in the generators "
                 "(relay.generators.reward_model); with algorithm.adv_estimator = prime the "
                 "reward_model section is PRIME's implicit PRM and enable has no effect"),
    *_inert(_FSDP, "reward_model.strategy", accept=("fsdp", "fsdp2")),
    VerlKey(key="reward_model.model.path", group="differs",
            note="with reward_model.enable, the discriminative reward model (a "
                 "*ForSequenceClassification or *ForTokenClassification folder, num_labels "
                 "= 1, or a causal LM with TRL's value head); with algorithm.adv_estimator = "
                 "prime, PRIME's implicit PRM (empty: the policy's checkpoint)"),
    *_same("reward_model.model.input_tokenizer", "reward_model.model.trust_remote_code",
           "reward_model.micro_batch_size_per_gpu", "reward_model.max_length"),
    *_refused(_DEPRECATED.format("reward_model.micro_batch_size"),
              "reward_model.micro_batch_size"),
    *_inert(_RM_ONLY, "reward_model.model.use_shm", "reward_model.model.use_remove_padding",
            "reward_model.model.use_fused_kernels", "reward_model.model.fsdp_config.*",
            "reward_model.use_dynamic_bsz", "reward_model.forward_max_token_len_per_gpu",
            "reward_model.profiler.*", "reward_model.ulysses_sequence_parallel_size"),
    *_inert("importing extra model code is not supported yet; only null",
            "reward_model.model.external_lib", accept=(None,)),
    VerlKey(key="reward_model.reward_manager", group="mapped",
            to=("custom_reward_function.reward_manager",),
            note="batch calls the custom function once per group with verl's batch "
                 "signature; naive, prime and dapo score sample by sample (DAPO's overlong "
                 "penalty is reward_model.overlong_buffer)"),
    *_inert("generators score rewards off the learner's path, always; no effect",
            "reward_model.launch_reward_fn_async"),
    *[VerlKey(key=f"reward_model.sandbox_fusion.{name}", group="mapped",
              to=(f"sandbox.sandbox_fusion.{name}",),
              note="the code sandbox's SandboxFusion server (relay.algorithms.sandbox)")
      for name in ("url", "max_concurrent", "memory_limit_mb")],
    # ---- verl's newer reward section (verl/trainer/config/reward/reward.yaml) ----------
    *[VerlKey(key=f"reward.custom_reward_function.{name}", group="mapped",
              to=(f"custom_reward_function.{name}",), note=_REWARD_SECTION)
      for name in ("path", "name")],
    VerlKey(key="reward.custom_reward_function.reward_kwargs.*", group="mapped",
            to=("custom_reward_function.reward_kwargs",), note=_REWARD_SECTION),
    VerlKey(key="reward.reward_manager.name", group="mapped",
            to=("custom_reward_function.reward_manager",), note=_REWARD_SECTION),
    VerlKey(key="reward.reward_model.enable", group="mapped", to=("reward_model.enable",),
            note=_REWARD_SECTION),
    VerlKey(key="reward.reward_model.model_path", group="mapped",
            to=("reward_model.model.path",), note=_REWARD_SECTION),
    *[VerlKey(key=f"reward.sandbox_fusion.{name}", group="mapped",
              to=(f"sandbox.sandbox_fusion.{name}",), note=_REWARD_SECTION)
      for name in ("url", "max_concurrent", "memory_limit_mb")],
    *_inert(_RM_PLACED, "reward.num_workers", "reward.reward_model.enable_resource_pool",
            "reward.reward_model.n_gpus_per_node", "reward.reward_model.nnodes",
            "reward.reward_model.rollout.*"),
    # ---- custom_reward_function, algorithm ---------------------------------------------
    *_same("custom_reward_function.path", "custom_reward_function.name", "algorithm.gamma",
           "algorithm.lam", "algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo",
           "algorithm.use_kl_in_reward", "algorithm.kl_penalty", "algorithm.kl_ctrl.type",
           "algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.horizon",
           "algorithm.kl_ctrl.target_kl"),
    *_inert("verl's PF-PPO reweights samples batch-wide; Relay's filters each prompt group "
            "(buffer.pf_ppo.enable); only false", "algorithm.use_pf_ppo", accept=(False,)),
    *_inert("used only with algorithm.use_pf_ppo (see relay.buffer.pf_ppo); no effect",
            "algorithm.pf_ppo.reweight_method", "algorithm.pf_ppo.weight_pow"),
    # ---- keys of verl's DAPO scripts (not in ppo_trainer.yaml) ---------------------------
    *[VerlKey(key=f"reward_model.reward_kwargs.overlong_buffer_cfg.{name}", group="mapped",
              to=(f"reward_model.overlong_buffer.{name}",),
              note="DAPO's overlong penalty, applied by Relay's generators to every reward")
      for name in ("enable", "len", "penalty_factor")],
    *_inert("each sample's penalty is always in its reward_info['overlong_reward']; no effect",
            "reward_model.reward_kwargs.overlong_buffer_cfg.log"),
    *_inert("the overlong penalty counts from rollout.response_length; no effect",
            "reward_model.reward_kwargs.max_resp_len"),
    *_inert("the buffer leases prompts as generators ask and regenerates dropped groups "
            "(buffer.filter_groups.max_num_gen_batches caps it); no effect",
            "data.gen_batch_size"),
])


def _index() -> dict[KeyPath, VerlKey]:
    index: dict[KeyPath, VerlKey] = {}
    for entry in TABLE:
        if entry.short in index:
            raise AssertionError(f"{entry.key} is in relay.configs.verl_keys.TABLE twice")
        index[entry.short] = entry
    return index


INDEX = _index()


def lookup(parts: Sequence[str | int]) -> VerlKey | None:
    """The entry for a key path (verl's or Relay's section names): its own, or the nearest
    subtree entry above it."""
    parts = shorten(tuple(parts))  # type: ignore[arg-type]
    if parts in INDEX:
        return INDEX[parts]
    for depth in range(len(parts) - 1, 0, -1):
        entry = INDEX.get(parts[:depth])
        if entry is not None and entry.subtree:
            return entry
    return None


class Placement(msgspec.Struct, frozen=True):
    """A placement key given in a run config, for the topology (``apply_placement``):
    ``key`` is its ``TABLE`` entry's; ``below``, for a subtree entry (``.*``), the path
    below it that was given (``("swap_space",)`` for ``engine_kwargs.vllm.swap_space``)."""

    key: str
    value: Any
    source: str
    below: KeyPath = ()

    @property
    def given(self) -> str:
        """The key as verl spells it, below a subtree entry included."""
        return format_key(parse_key(self.key.removesuffix(".*")) + self.below)


class VerlKeys:
    """The translator ``relay.configs.loader`` calls for each key the run schema lacks.

    ``placement``: the placement keys seen, in order; None refuses them (a caller that
    cannot apply them to a topology). ``notes``: one line per verl key translated or
    without effect, for ``--dry-run`` (each is also logged)."""

    def __init__(self, placement: list[Placement] | None = None) -> None:
        self.placement = placement
        self.notes: list[str] = []

    def known(self) -> Iterable[KeyPath]:
        return (entry.short for entry in TABLE if entry.group != "refused")

    def translate(self, parts: KeyPath, value: Any,
                  source: str) -> list[tuple[KeyPath, Any]] | None:
        entry = lookup(parts)
        if entry is None:
            return None
        key = format_key(parts)
        if entry.group == "refused":
            raise ConfigError(source, key, f"verl's {entry.key} is refused: {entry.note}")
        if entry.group == "mapped":
            return self._mapped(entry, parts, value, source)
        if entry.accept is not None and not any(_equal(value, ok) for ok in entry.accept):
            raise ConfigError(source, key, f"{value!r} is not supported: {entry.note}")
        self._note(f"{key} = {value!r}: {entry.note}")
        return []

    def _mapped(self, entry: VerlKey, parts: KeyPath, value: Any,
                source: str) -> list[tuple[KeyPath, Any]]:
        key, targets = format_key(parts), ", ".join(entry.to)
        places = any(to.startswith(TOPOLOGY) for to in entry.to)
        if places and self.placement is None:
            raise ConfigError(source, key, f"a placement, which Relay keeps in the topology "
                                           f"({targets}): {entry.note}")
        if value is None:  # verl's null: Relay's default
            self._note(f"{key} = null: Relay's default for {targets}")
            return []
        self.notes.append(f"{key} = {value!r} -> {targets}")
        if places and self.placement is not None:
            below = shorten(parts)[len(entry.short):] if entry.subtree else ()
            self.placement.append(Placement(key=entry.key, value=value, source=source,
                                            below=below))
            return []
        below = shorten(parts)[len(entry.short):] if entry.subtree else ()
        return [(parse_key(to) + below, value) for to in entry.to]  # type: ignore[misc]

    def _note(self, line: str) -> None:
        self.notes.append(line)  # printed at launch and kept in RUN_DIR/verl-keys.txt


def _equal(value: Any, accepted: Any) -> bool:
    if isinstance(accepted, bool) or isinstance(value, bool):
        return value is accepted
    return value == accepted


def apply_placement(topology: Topology, placement: Sequence[Placement]) -> Topology:
    """The topology with the run config's placement keys applied (``TABLE``'s notes)."""
    for item in placement:
        learner = topology.learner
        if item.key == "trainer.n_gpus_per_node":
            if not isinstance(item.value, int) or isinstance(item.value, bool) or item.value < 1:
                raise ConfigError(item.source, item.key, f"expected an integer >= 1, got "
                                                         f"{item.value!r}")
            topology = msgspec.structs.replace(topology, learner=msgspec.structs.replace(
                learner, nproc_per_node=item.value))
        elif item.key == "trainer.nnodes" and topology.launcher.backend in ("ray", "slurm"):
            if not isinstance(item.value, int) or isinstance(item.value, bool) or item.value < 1:
                raise ConfigError(item.source, item.key, f"expected an integer >= 1, got "
                                                         f"{item.value!r}")
            topology = msgspec.structs.replace(topology, learner=msgspec.structs.replace(
                learner, nnodes=item.value))
        elif item.key == "trainer.nnodes":
            if item.value != len(learner.hosts):
                raise ConfigError(item.source, item.key,
                                  f"{item.value!r} nodes, but the topology lists "
                                  f"{len(learner.hosts)} learner host(s) (learner.hosts): Relay "
                                  "starts one torchrun per host listed there; list them there")
        elif item.key == "ray_init.num_cpus":
            if not isinstance(item.value, int) or isinstance(item.value, bool) or item.value < 1:
                raise ConfigError(item.source, item.key, f"expected an integer >= 1, got "
                                                         f"{item.value!r}")
            launcher = topology.launcher
            topology = msgspec.structs.replace(topology, launcher=msgspec.structs.replace(
                launcher, ray=msgspec.structs.replace(launcher.ray, num_cpus=item.value)))
        elif item.key == "trainer.device":
            if item.value not in ("cuda", "cpu"):
                raise ConfigError(item.source, item.key, f"expected 'cuda' or 'cpu' (the "
                                                         f"learner's device), got {item.value!r}")
            topology = msgspec.structs.replace(topology, learner=msgspec.structs.replace(
                learner, device=item.value))
        elif item.key == ROLLOUT_NAME:
            topology = _engine(topology, item)
        elif item.key.startswith(f"{R}.engine_kwargs."):
            topology = _engine_kwargs(topology, item)
        elif item.key.removeprefix(f"{R}.") in ENGINE_KNOBS:
            topology = _engine_knob(topology, item)
        else:
            raise AssertionError(f"no placement rule for {item.key}")
    return topology


def _engine(topology: Topology, item: Placement) -> Topology:
    engines = EngineName.__args__  # type: ignore[attr-defined]
    if item.value not in engines:
        raise ConfigError(item.source, item.key, f"unknown engine {item.value!r}; Relay's "
                                                 f"engines are {', '.join(engines)}")
    generators = [msgspec.structs.replace(g, engine=item.value) for g in topology.generators]
    evaluator = msgspec.structs.replace(topology.evaluator, engine=item.value)
    return msgspec.structs.replace(topology, generators=generators, evaluator=evaluator)


EngineOptions = LeanOptions | VLLMOptions | SGLangOptions


def _sections(topology: Topology, engines: Sequence[str],
              edit: Callable[[EngineOptions], EngineOptions]) -> Topology:
    """The topology with ``edit`` applied to the ``engines`` sections (``vllm``, ``sglang``)
    of every generator and of the evaluator."""
    def placed(at: GeneratorPlacement | EvaluatorPlacement) -> Any:
        return msgspec.structs.replace(at, **{e: edit(getattr(at, e)) for e in engines})
    return msgspec.structs.replace(topology, evaluator=placed(topology.evaluator),
                                   generators=[placed(g) for g in topology.generators])


def _option(options: EngineOptions, name: str, value: Any, item: Placement) -> EngineOptions:
    """``options`` with ``name`` set to ``value``, checked by the topology schema."""
    try:
        checked = msgspec.convert({name: value}, type(options))
    except msgspec.ValidationError as exc:
        problem = str(exc).split(" - at ")[0]
        raise ConfigError(item.source, item.given,
                          f"{value!r} is not a valid {type(options).__name__}.{name} "
                          f"(configs/topology_schema.py): {problem}") from None
    return msgspec.structs.replace(options, **{name: getattr(checked, name)})


def _engine_knob(topology: Topology, item: Placement) -> Topology:
    """One of ``ENGINE_KNOBS`` set in the sections it configures (``_knob_sections``)."""
    name = item.key.removeprefix(f"{R}.")
    return _sections(topology, _knob_sections(name),
                     lambda options: _option(options, name, item.value, item))


def _engine_kwargs(topology: Topology, item: Placement) -> Topology:
    """``engine_kwargs.<engine>.<name> = value`` added to that engine's ``engine_kwargs``
    (a path below the name sets a nested table; the whole ``engine_kwargs.<engine>`` table
    adds each of its arguments)."""
    engine = item.key.removesuffix(".*").rpartition(".")[2]
    value = item.value
    for name in reversed(item.below):
        value = {name: value}

    def edit(options: EngineOptions) -> EngineOptions:
        return _option(options, "engine_kwargs", _merged(options.engine_kwargs, value), item)
    return _sections(topology, (engine,), edit)


def _merged(base: dict[str, Any], extra: Any) -> Any:
    """``extra`` merged into the table ``base``, nested tables merged too."""
    if not isinstance(extra, dict):
        return extra
    return {**base, **{k: _merged(base[k], v) if isinstance(base.get(k), dict) else v
                       for k, v in extra.items()}}


def markdown_table() -> str:
    """``TABLE`` as the markdown of ``configs/verl-keys.md``, grouped, with the counts."""
    lines = ["# verl's config keys in Relay", "",
             "Generated from `configs/verl_keys.py` by `tools/gen-verl-docs.py`; do not "
             "edit by hand. verl's `actor_rollout_ref.actor.X`, `.rollout.X`, `.model.X` and "
             "`.ref.X` are Relay's `actor.X`, `rollout.X`, `model.X` and `ref.X`; both "
             "spellings work in a run config and on the command line. A key Relay lacks is "
             "accepted with the values in its *accepts* column (the others are refused with "
             "the note) and has no further effect; a key Relay has takes its schema's values "
             "(`configs/run_schema.py`).", ""]
    counts = {group: sum(e.group == group for e in TABLE) for group in GROUP_TITLES}
    lines += [f"- {GROUP_TITLES[g]}: {counts[g]} entries" for g in GROUP_TITLES]
    for group, title in GROUP_TITLES.items():
        lines += ["", f"## {title[0].upper()}{title[1:]}", "",
                  "| verl key | Relay | accepts | note |", "| --- | --- | --- | --- |"]
        for entry in sorted((e for e in TABLE if e.group == group), key=lambda e: e.key):
            relay = ", ".join(f"`{t}`" for t in entry.to) if entry.to else (
                f"`{format_key(entry.short)}`" if in_schema(entry.short) else "")
            accepts = "" if group == "refused" or relay else (
                "any value" if entry.accept is None
                else "only " + " or ".join(f"`{msgspec.json.encode(v).decode()}`"
                                           for v in entry.accept))
            note = entry.note.replace("|", "\\|")
            lines.append(f"| `{entry.key}` | {relay} | {accepts} | {note} |")
    return "\n".join(lines) + "\n"
