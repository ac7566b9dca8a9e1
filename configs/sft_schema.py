"""The SFT run config (``relay sft``): verl's ``fsdp_sft_trainer`` keys, typed and checked.

The keys and their defaults are those of verl's ``sft_trainer.yaml`` (``data.*``,
``model.*``, ``optim.*``, ``trainer.*``, ``ulysses_sequence_parallel_size``,
``use_remove_padding``), so a verl SFT command line's ``key=value`` overrides work as they
are. Every section forbids unknown keys: a misspelt or unsupported key is a ``ConfigError``
naming it and the closest valid key (``relay.configs.loader``). A config is a YAML or TOML
file, or nothing at all (every key from the command line); ``load_sft_config`` reads it.

Relay's additions, each beside verl's meaning: ``data.use_dynamic_bsz`` with
``data.max_token_len_per_gpu`` (a token budget per pass, as the RL learner's
``actor.use_dynamic_bsz``), ``model.dtype`` (the compute dtype over fp32 master weights),
``trainer.n_gpus_per_node`` (the ranks ``relay sft`` starts on this host with torchrun),
``trainer.device``, ``trainer.tracking_uri`` (the MLflow store; default:
``default_local_dir/mlflow.db``) and ``trainer.resume_mode`` with
``trainer.resume_from_path`` (verl's newer trainer's names).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from relay.configs.loader import (
    COMMAND_LINE,
    ConfigError,
    _resolve_paths,
    apply_overrides,
    check_unknown_keys,
    explain_validation_error,
    read_toml,
)
from relay.configs.hub import looks_like_hub_id
from relay.configs.run_schema import ModelConfig, OptimConfig

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]
Truncation = Literal["error", "left", "right"]
ResumeMode = Literal["auto", "disable", "resume_path"]
FileList = str | list[str]


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every SFT config section."""


class MultiturnConfig(_Section):
    """``data.multiturn``: rows are chats (a list of ``{"role", "content"}`` messages under
    ``messages_key``); the loss is on every assistant turn."""

    enable: bool = False
    messages_key: str = "messages"


class SftDataConfig(_Section):
    """The SFT data (verl's ``data``): parquet or JSONL files of rows.

    Single-turn rows hold a prompt under ``prompt_key`` and its response under
    ``response_key``, or, with ``prompt_dict_keys`` / ``response_dict_keys``, under those
    keys of the object there (verl's gsm8k example: ``prompt_key=extra_info``,
    ``prompt_dict_keys=['question']``) (the prompt goes through the tokenizer's chat template as one user
    turn; the loss is on the response and the eos after it). ``train_batch_size`` counts
    rows per optimizer step over all ranks; ``micro_batch_size_per_gpu`` rows a forward
    pass, or, with ``use_dynamic_bsz``, passes of at most ``max_token_len_per_gpu`` tokens
    (rows x longest row). A row longer than ``max_length`` tokens is refused (``error``) or
    cut, keeping its end (``left``) or its start (``right``).
    """

    train_files: FileList
    val_files: FileList = msgspec.field(default_factory=list)
    prompt_key: str = "prompt"
    response_key: str = "response"
    prompt_dict_keys: list[str] = msgspec.field(default_factory=list)
    response_dict_keys: list[str] = msgspec.field(default_factory=list)
    multiturn: MultiturnConfig = msgspec.field(default_factory=MultiturnConfig)
    train_batch_size: PositiveInt = 256
    micro_batch_size_per_gpu: PositiveInt = 4
    use_dynamic_bsz: bool = False
    max_token_len_per_gpu: PositiveInt = 8192
    max_length: PositiveInt = 1024
    truncation: Truncation = "error"

    def train_list(self) -> list[str]:
        return [self.train_files] if isinstance(self.train_files, str) else self.train_files

    def val_list(self) -> list[str]:
        return [self.val_files] if isinstance(self.val_files, str) else self.val_files


class SftModelConfig(_Section):
    """The model (verl's ``model``): ``partial_pretrain``, a Hugging Face folder (or hub
    ID) to fine-tune, trained in fp32 master weights computing in ``dtype``.

    LoRA (verl's ``lora_rank``, ``lora_alpha``, ``target_modules``; with the RL policy's
    ``exclude_modules`` and ``lora_adapter_path``): ``lora_rank`` > 0 trains peft adapters
    alone, as the RL learner does (``relay.configs.run_schema.ModelConfig``,
    ``relay.learner.lora``); the output folder holds the merged weights."""

    partial_pretrain: str
    enable_gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora_rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    lora_alpha: PositiveFloat = 16.0
    target_modules: str | list[str] = "all-linear"
    exclude_modules: str | list[str] | None = None
    lora_adapter_path: str | None = None

    def lora(self) -> ModelConfig | None:
        """The RL policy's ``ModelConfig`` holding these LoRA keys (what
        ``relay.learner.model.load_sharded`` takes), or None without LoRA."""
        if self.lora_rank == 0:
            return None
        return ModelConfig(path=self.partial_pretrain, lora_rank=self.lora_rank,
                           lora_alpha=self.lora_alpha, target_modules=self.target_modules,
                           exclude_modules=self.exclude_modules,
                           lora_adapter_path=self.lora_adapter_path,
                           trust_remote_code=self.trust_remote_code)


class SftOptimConfig(_Section):
    """AdamW and its schedule (verl's ``optim``): linear warm-up over
    ``warmup_steps_ratio`` of the run, then ``cosine`` down to ``min_lr_ratio * lr`` or
    ``constant``; gradients clipped to norm ``clip_grad``."""

    lr: PositiveFloat = 1e-5
    betas: Annotated[list[float], msgspec.Meta(min_length=2, max_length=2)] = msgspec.field(
        default_factory=lambda: [0.9, 0.95])
    weight_decay: NonNegativeFloat = 0.01
    warmup_steps_ratio: Fraction = 0.1
    clip_grad: PositiveFloat = 1.0
    lr_scheduler: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: Fraction = 0.0

    def as_optim(self) -> OptimConfig:
        """The RL learner's ``OptimConfig`` of the same optimizer and schedule
        (``relay.learner.optim``)."""
        return OptimConfig(lr=self.lr, weight_decay=self.weight_decay, betas=list(self.betas),
                           lr_warmup_steps=-1, lr_warmup_steps_ratio=self.warmup_steps_ratio,
                           warmup_style=self.lr_scheduler, min_lr_ratio=self.min_lr_ratio)


class SftTrainerConfig(_Section):
    """The run (verl's ``trainer``). ``total_training_steps`` (when set) overrides
    ``total_epochs`` x steps per epoch. Every ``save_freq`` steps (and at the last) a
    checkpoint ``global_step_<N>`` is written under ``default_local_dir`` (-1: only the
    last); every ``test_freq`` steps (and at the last) the loss on ``data.val_files`` is
    measured (-1: only at the last). ``resume_mode``: ``auto`` continues from the newest
    complete checkpoint in ``default_local_dir`` if there is one, ``resume_path`` from
    ``resume_from_path``, ``disable`` starts afresh. ``logger``: ``console`` prints a
    progress line a step; MLflow always records (to ``tracking_uri``), and ``wandb``,
    ``tensorboard``, ``swanlab`` add those trackers."""

    default_local_dir: str = ""
    project_name: str = "relay-sft"
    experiment_name: str = "sft"
    total_epochs: PositiveInt = 4
    total_training_steps: PositiveInt | None = None
    logger: list[Literal["console", "mlflow", "wandb", "tensorboard", "swanlab"]] = \
        msgspec.field(default_factory=lambda: ["console"])
    save_freq: int = -1
    test_freq: int = -1
    seed: int = 1
    resume_mode: ResumeMode = "auto"
    resume_from_path: str | None = None
    max_ckpt_to_keep: PositiveInt | None = None
    n_gpus_per_node: PositiveInt = 1
    nnodes: Literal[1] = 1
    device: Literal["cpu", "cuda", "auto"] = "auto"
    tracking_uri: str = ""

    def output_dir(self) -> Path:
        """``default_local_dir``, or verl's default ``checkpoints/<project>/<experiment>``."""
        return Path(self.default_local_dir or
                    f"checkpoints/{self.project_name}/{self.experiment_name}")


class SftConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A whole SFT run."""

    data: SftDataConfig
    model: SftModelConfig
    optim: SftOptimConfig = msgspec.field(default_factory=SftOptimConfig)
    trainer: SftTrainerConfig = msgspec.field(default_factory=SftTrainerConfig)
    ulysses_sequence_parallel_size: PositiveInt = 1
    use_remove_padding: bool = False


PATH_KEYS = (("data", "train_files"), ("data", "val_files"), ("model", "partial_pretrain"),
             ("model", "lora_adapter_path"), ("trainer", "default_local_dir"),
             ("trainer", "resume_from_path"))
"""Keys holding local paths: relative to the config file's folder when set there, to the
working directory when set on the command line."""


def read_config_file(path: Path) -> dict[str, Any]:
    """A YAML (``.yaml``/``.yml``) or TOML file as nested tables; errors name the file."""
    if path.suffix not in (".yaml", ".yml"):
        return read_toml(path)
    import yaml

    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_yaml_loader())
    except FileNotFoundError:
        raise ConfigError(str(path), "", "file not found") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(str(path), "", f"not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), "", f"the top level must be a mapping, not "
                                         f"{type(data).__name__}")
    return data


def _yaml_loader() -> type:
    """PyYAML's safe loader reading ``1e-5`` as a float, as OmegaConf (verl's loader)
    does: YAML 1.1 wants ``1.0e-5`` and would give the string "1e-5"."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                    |\.[0-9_]+(?:[eE][-+][0-9]+)?
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.X),
        list("-+0123456789."))
    return Loader


def load_sft_config(path: str | Path | None, overrides: Iterable[str] = ()) -> SftConfig:
    """The SFT config of file ``path`` (None: none) with verl-style ``key=value``
    ``overrides`` applied (``relay.configs.loader.apply_overrides``); a ``ConfigError``
    naming the source, the key and the problem for anything wrong."""
    source = str(path) if path is not None else COMMAND_LINE
    data = read_config_file(Path(path)) if path is not None else {}
    _check_interpolation(data, source)
    check_unknown_keys(SftConfig, data, source)
    touched = apply_overrides(SftConfig, data, overrides)
    base = Path(path).parent.resolve() if path is not None else Path.cwd()
    for key in PATH_KEYS:
        where = Path.cwd() if any(key[:len(t)] == t for t in touched) else base
        # a hub ID (model.partial_pretrain = "Qwen/Qwen2.5-0.5B") that is no local path
        keep = (lambda v, b=where: looks_like_hub_id(v) and not (b / v).exists()) \
            if key == ("model", "partial_pretrain") else (lambda v: False)
        _resolve_paths(data, key, base=where, only_if=lambda v, k=keep: not k(v))

    def source_of(parts: Any) -> str:
        return COMMAND_LINE if any(tuple(parts[:len(t)]) == t for t in touched) else source

    try:
        config = msgspec.convert(data, type=SftConfig)
    except msgspec.ValidationError as exc:
        raise explain_validation_error(SftConfig, data, exc, source_of) from None
    check_sft_config(config, source)
    return config


def _check_interpolation(data: Any, source: str, prefix: str = "") -> None:
    """verl's YAML interpolates ``${trainer.project_name}``; Relay's config does not: such
    a value is refused naming its key rather than used as a literal path."""
    if isinstance(data, dict):
        for name, value in data.items():
            _check_interpolation(value, source, f"{prefix}.{name}" if prefix else str(name))
    elif isinstance(data, str) and "${" in data:
        raise ConfigError(source, prefix, f"{data!r}: interpolation (${{...}}) is not "
                                          "supported; write the value out")


def check_sft_config(config: SftConfig, source: str) -> None:
    """The checks across keys: a ConfigError naming the key."""
    if not config.data.train_list():
        raise ConfigError(source, "data.train_files", "names no file")
    if config.trainer.resume_mode == "resume_path" and not config.trainer.resume_from_path:
        raise ConfigError(source, "trainer.resume_from_path",
                          "must be set when trainer.resume_mode = 'resume_path'")
    if config.trainer.save_freq == 0:
        raise ConfigError(source, "trainer.save_freq", "0: use -1 (save at the end only) "
                                                       "or a positive step count")
    if config.trainer.test_freq == 0:
        raise ConfigError(source, "trainer.test_freq", "0: use -1 (at the end only) or a "
                                                       "positive step count")
