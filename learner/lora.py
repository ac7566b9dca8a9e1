"""LoRA on the policy and the critic with peft: wrapping, the reference, merged weights,
adapter files.

``wrap`` (called by ``relay.learner.model.load_sharded`` before ``fully_shard``, on rank 0's
loaded model and on the other ranks' ``meta`` one alike) makes the policy a peft model:
fresh adapters (``LoraConfig`` from ``model.lora_rank``, ``lora_alpha``,
``target_modules``, ``exclude_modules``; dropout 0, no bias), or those of
``model.lora_adapter_path``. peft freezes the base weights, so only the adapters'
parameters require gradients, and the optimizer (``relay.learner.optim.build_optimizer``:
the parameters that require gradients) holds state for them alone. A LoRA linear layer
computes

    y = W x + (alpha / r) * B (A x)        A: (r, in), B: (out, r), B = 0 at the start

The reference model of KL (``actor.use_kl_loss``, ``algorithm.use_kl_in_reward``) is the
policy itself under ``adapters_disabled``: y = W x, the frozen base, with no second copy.

Publishing. When every engine of the run is vLLM with its LoRA support on
(``relay.configs.lora_publish``), a publish sends the adapters alone (``adapter_parameters``,
under peft's file names; ``relay.generators.vllm_lora`` loads them). Otherwise: the engines
(lean, torch, vLLM, SGLang) load full Hugging Face weights by name,
so a LoRA policy publishes (and writes its ``hf/`` folders) as merged weights,
``W' = W + (alpha / r) B A`` under the base model's names (``MergedWeights``): each merged
tensor is computed from this rank's rows of W and the full (small) A and B when the
publish reaches it, never written back into W. Checkpoints also hold the adapters in
peft's format (``save_adapter``: ``adapter_model.safetensors``, ``adapter_config.json``),
which ``PeftModel.from_pretrained`` loads, and ``write_merged`` merges such a folder into
its base model for ``relay export --merge-lora``.

The critic (``critic.model.lora_rank`` > 0, ``relay.learner.critic``) wraps its body alone
with ``wrap_body`` (no task type, errors naming ``critic.model``): its value head stays
outside peft and trains whole, beside the body's adapters. Its checkpoints hold its
adapters in peft's format with its head beside them (``save_critic_adapter``), and
``merged_state`` folds a full peft state dict into its base model's names for
``relay export --critic``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from relay.configs.lora_adapter import (ADAPTER, ADAPTER_CONFIG, ADAPTER_WEIGHTS, KEY,
                                        file_name, fresh_config, is_adapter, lora_config)
from relay.configs.run_schema import CriticModelConfig, ModelConfig
from relay.learner.hf_export import commit_folder, partial_folder, set_config_dtype
from relay.learner.weight_buckets import held_rows

logger = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."  # what peft puts before the base model's names
CRITIC_KEY = "critic.model"
HEAD_WEIGHTS = "value_head.safetensors"


def enabled(model_config: ModelConfig | CriticModelConfig) -> bool:
    """Whether the run trains LoRA adapters (``model.lora_rank`` > 0)."""
    return model_config.lora_rank > 0


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` is a peft LoRA model (``wrap``'s)."""
    return isinstance(model, PeftModel)


def linear_names(model: nn.Module) -> list[str]:
    """The last names of ``model``'s linear modules (what ``target_modules`` lists)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, nn.Linear) and name})


def check_target_modules(model: nn.Module, config: LoraConfig, key: str = KEY) -> None:
    """ValueError naming ``target_modules`` (or ``exclude_modules``) and the model's linear
    module names when a listed name matches no linear module (a regular expression or
    ``all-linear`` is peft's to match: ``wrap`` names the key when it matches nothing)."""
    paths = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and name]
    section = key
    for key, names in (("target_modules", config.target_modules),
                       ("exclude_modules", config.exclude_modules)):
        if not isinstance(names, (set, list, tuple)):
            continue
        # peft's rule: a name matches a module whose path is it or ends with "." + it
        unknown = sorted(name for name in names
                         if not any(p == name or p.endswith(f".{name}") for p in paths))
        if unknown:
            raise ValueError(f"{section}.{key}: {unknown} name no linear module of "
                             f"{type(model).__name__}; its linear modules are "
                             f"{linear_names(model)} "
                             "(or give 'all-linear', or a regular expression)")


def wrap(model: nn.Module, model_config: ModelConfig, *, load_adapter: bool) -> PeftModel:
    """``model`` with LoRA adapters (module docstring), before sharding. ``load_adapter``:
    read ``lora_adapter_path``'s weights (rank 0, which reads the checkpoint); the other
    ranks build the same modules on ``meta`` and receive them with the base weights."""
    adapter = model_config.lora_adapter_path if load_adapter else None
    return _peft(model, lora_config(model_config), KEY, adapter)


def wrap_body(body: nn.Module, model_config: CriticModelConfig) -> PeftModel:
    """The critic's ``body`` with fresh LoRA adapters (``critic.model``'s keys), before
    sharding, on every rank alike (the adapters reach the other ranks with the weights)."""
    peft_body = _peft(body, fresh_config(model_config, task_type=None), CRITIC_KEY, None)
    for name, module in peft_body.named_modules():
        if isinstance(module, LoraLinear) and module.fan_in_fan_out:
            raise ValueError(f"{CRITIC_KEY}.target_modules takes {name}, a fan-in-fan-out "
                             "layer (GPT-2's Conv1D): a LoRA critic takes nn.Linear layers "
                             "only; list others in target_modules")
    return peft_body


def _peft(model: nn.Module, config: LoraConfig, key: str, adapter: str | None) -> PeftModel:
    """``model`` under peft: ``adapter``'s folder loaded trainable, else ``config``'s fresh
    adapters; ValueError naming ``key``'s ``target_modules`` when they match no linear
    module or take a non-linear one."""
    check_target_modules(model, config, key)
    try:
        if adapter is not None:
            peft_model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
        else:
            peft_model = get_peft_model(model, config)
    except ValueError as exc:  # peft's own: a regular expression that matches nothing
        raise ValueError(f"{key}.target_modules = {config.target_modules!r}: {exc} (its "
                         f"linear modules are {linear_names(model)})") from exc
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer) and not isinstance(module, LoraLinear):
            raise ValueError(f"{key}.target_modules takes {name} ({type(module).__name__}): "
                             "Relay trains LoRA on linear modules only")
    return peft_model


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` (a LoRA policy) as its frozen base: y = W x (the KL reference)."""
    with model.disable_adapter():
        yield


def hf_name(peft_name: str) -> str:
    """A base parameter's Hugging Face name from its peft name:
    ``base_model.model.model.layers.0.mlp.up_proj.base_layer.weight`` ->
    ``model.layers.0.mlp.up_proj.weight``."""
    return peft_name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def base_shapes(model: nn.Module) -> list[tuple[str, torch.Size]]:
    """The published (Hugging Face) names and shapes of a LoRA model's base parameters,
    in ``named_parameters`` order."""
    return [(hf_name(name), param.shape) for name, param in model.named_parameters()
            if not is_adapter(name)]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a (sharded) tensor, detached; a collective for a DTensor."""
    tensor = tensor.detach()
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class MergedWeights(Mapping[str, torch.Tensor]):
    """A LoRA model's weights as the engines take them: its base parameters by Hugging Face
    name, each adapted one merged, W' = W + (alpha / r) B A, sharded as W (this rank's rows
    only). Made on every rank (a collective: A and B are gathered whole, the adapters
    being small); a merged tensor is computed when asked for, the last one kept."""

    def __init__(self, model: nn.Module) -> None:
        self._base: dict[str, nn.Parameter] = {hf_name(name): param for name, param
                                               in model.named_parameters()
                                               if not is_adapter(name)}
        self._deltas: dict[str, tuple[torch.Tensor, torch.Tensor, float, bool]] = {}
        for name, module in model.named_modules():
            if isinstance(module, LoraLinear) and ADAPTER in module.lora_A:
                b, a = (_full(module.lora_B[ADAPTER].weight),
                        _full(module.lora_A[ADAPTER].weight))
                self._deltas[hf_name(f"{name}.base_layer.weight")] = (
                    b, a, float(module.scaling[ADAPTER]), bool(module.fan_in_fan_out))
        self._last: tuple[str, torch.Tensor] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._deltas:
            return self._base[name]
        if self._last is None or self._last[0] != name:
            self._last = (name, self._merged(name))
        return self._last[1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)

    @torch.no_grad()
    def _merged(self, name: str) -> torch.Tensor:
        """W' of ``name``: this rank's rows [lo, hi) of W plus rows [lo, hi) of
        (alpha / r) B A (of its transpose for a fan-in-fan-out layer), in W's dtype."""
        weight = self._base[name]
        b, a, scale, transposed = self._deltas[name]
        local = weight.to_local() if isinstance(weight, DTensor) else weight.detach()
        lo = _first_row(weight)
        hi = lo + local.shape[0]
        if transposed:  # W is (in, out): W' = W + scale (B A)^T = W + scale A^T B^T
            left, right = a.t()[lo:hi], b.t()
        else:
            left, right = b[lo:hi], a
        left, right = left.to(local.device, torch.float32), right.to(local.device, torch.float32)
        # one fused pass, no (rows x in) temporary beside the result: addmm(W, L, R) = W + s L R
        merged = torch.addmm(local.float(), left, right, alpha=scale).to(local.dtype)
        if not isinstance(weight, DTensor):
            return merged
        return DTensor.from_local(merged, weight.device_mesh, weight.placements,
                                  run_check=False, shape=weight.shape, stride=weight.stride())


def _first_row(weight: torch.Tensor) -> int:
    """The index of this rank's first row of ``weight`` (FSDP2's Shard(0)); 0 unsharded."""
    if not isinstance(weight, DTensor):
        return 0
    mesh = weight.device_mesh
    return held_rows(weight.shape[0], mesh.size(mesh.ndim - 1),
                     mesh.get_local_rank(mesh.ndim - 1))[0]


def log_publish_choice(engines: str, adapters: bool) -> None:
    """Say (once, at the learner's start) which weights a LoRA policy publishes to the
    engines ``engines`` (``relay.configs.lora_publish``)."""
    if adapters:
        logger.info("publish: LoRA adapters only, A and B under peft's names (engine %s "
                    "runs them with vLLM's LoRA support)", engines)
    else:
        logger.info("publish: merged LoRA weights W + (alpha/r) B A under the base model's "
                    "names (engine %s takes full weights)", engines)


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """``model``'s adapter parameters (sharded as they are) under peft's file names, in
    ``named_parameters`` order: what an adapters-only publish sends."""
    return {file_name(name): param for name, param in model.named_parameters()
            if is_adapter(name)}


def adapter_shapes(model: nn.Module) -> list[tuple[str, torch.Size]]:
    """The names (peft's file names) and full shapes of ``model``'s adapters."""
    return [(name, param.shape) for name, param in adapter_parameters(model).items()]


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors, whole, under peft's file names; a collective under FSDP2,
    every rank gets them."""
    return {name: _full(param).cpu().contiguous()
            for name, param in adapter_parameters(model).items()}


def save_adapter(model: nn.Module, folder: Path, group: dist.ProcessGroup | None = None,
                 base_path: str | None = None) -> None:
    """Write ``model``'s adapters into ``folder`` in peft's format (a collective: every rank
    calls it, rank 0 writes): ``adapter_model.safetensors`` (fp32) and
    ``adapter_config.json`` naming ``base_path`` (default: the path peft recorded) as the
    base model."""
    state = adapter_state(model)
    if dist.is_initialized() and dist.get_rank(group) != 0:
        return
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.float() for k, v in state.items()}, str(folder / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    config = model.peft_config[ADAPTER]
    config.save_pretrained(str(folder))
    if base_path is not None:
        path = folder / ADAPTER_CONFIG
        saved = json.loads(path.read_text(encoding="utf-8"))
        saved["base_model_name_or_path"] = base_path
        path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_merged(adapter: Path, out: Path, dtype: torch.dtype, base_path: str | None = None,
                 tokenizer_from: Path | None = None) -> None:
    """``out``: the Hugging Face model of ``adapter``'s base (``base_path``, default its
    ``adapter_config.json``'s ``base_model_name_or_path``) with the adapter merged in,
    W + (alpha / r) B A computed in fp32 (peft's ``merge_and_unload``), saved in ``dtype``
    as safetensors with its config, generation config and the tokenizer of
    ``tokenizer_from`` (default: none), atomically (``relay.learner.hf_export``)."""
    if not (adapter / ADAPTER_CONFIG).is_file():
        raise ValueError(f"{adapter}: no {ADAPTER_CONFIG} (a checkpoint written with "
                         "model.lora_rank > 0 holds its adapters in adapter/)")
    base = base_path or LoraConfig.from_pretrained(str(adapter)).base_model_name_or_path
    if not base or not Path(base).is_dir():
        raise ValueError(f"{adapter / ADAPTER_CONFIG}: its base model {base!r} is not a local "
                         "folder: pass the base model's folder")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    partial = partial_folder(out)
    merged.to(dtype).save_pretrained(str(partial))
    set_config_dtype(partial, dtype)
    if tokenizer_from is not None:
        AutoTokenizer.from_pretrained(str(tokenizer_from)).save_pretrained(str(partial))
    commit_folder(partial, out)


def save_critic_adapter(body: nn.Module, head: nn.Module, folder: Path,
                        group: dist.ProcessGroup | None = None) -> None:
    """Write a LoRA critic's ``body`` adapters into ``folder`` in peft's format
    (``save_adapter``) and its value ``head`` whole beside them (``value_head.safetensors``:
    ``weight`` (1, H), ``bias`` (1,), fp32); a collective, rank 0 writes."""
    save_adapter(body, folder, group=group)
    head_state = {name: _full(param).cpu().float().contiguous()
                  for name, param in head.named_parameters()}
    if dist.is_initialized() and dist.get_rank(group) != 0:
        return
    save_file(head_state, str(folder / HEAD_WEIGHTS), metadata={"format": "pt"})


def adapter_scale(folder: Path) -> float:
    """alpha / r of the peft adapter folder ``folder`` (its ``adapter_config.json``)."""
    config = LoraConfig.from_pretrained(str(folder))
    return config.lora_alpha / config.r


def merged_state(state: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A LoRA model's full state dict (peft's parameter names, under any prefix) under its
    base model's names, each adapted weight merged in fp32 and kept in W's dtype:

        W' = W + scale * B A        A: (r, in), B: (out, r), scale = alpha / r

    ``...base_model.model.X.base_layer.weight`` -> ``...X.weight``; the adapters are
    dropped. For ``nn.Linear`` layers (``wrap_body`` refuses fan-in-fan-out ones)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_adapter(name):
            continue
        base_name = name.replace(PEFT_PREFIX, "", 1).replace(".base_layer.", ".")
        a_name = name.replace(".base_layer.weight", f".lora_A.{ADAPTER}.weight")
        if name.endswith(".base_layer.weight") and a_name in state:
            b = state[name.replace(".base_layer.weight", f".lora_B.{ADAPTER}.weight")]
            tensor = torch.addmm(tensor.float(), b.float(), state[a_name].float(),
                                 alpha=scale).to(tensor.dtype)
        out[base_name] = tensor
    return out
