"""DeepSpeed ZeRO as the policy's training engine (``actor.strategy = "deepspeed"``).

OpenRLHF trains its actor in a DeepSpeed engine (ZeRO-2 or ZeRO-3, the optimizer on the
CPU with ``--adam_offload``); Relay offers the same beside FSDP2 with the rest of the
learner unchanged: its passes (micro-batches, dynamic batch sizes, shared prompts), its
losses, its learning-rate schedule, the weight publish and the checkpoints. DeepSpeed only
partitions, reduces and steps:

- forward: through the engine (``ZeroEngine.policy``, an ``EngineForward``), whose hooks
  gather a ZeRO-3 block's parameters for its pass (a forward of the bare module after a
  backward computes with what the previous pass left: 5e-2 off at two passes a step). It
  is the model's own forward, logits at every position: FSDP2's passes run the body and
  then the head at the response positions only (``relay.learner.logprob_head``), reading the
  head's weight outside any module's forward, where ZeRO-3 has not gathered it;
- backward: ``engine.backward(loss, scale_wrt_gas=False)`` for each pass, the
  accumulation boundary set on the mini-batch's last pass. DeepSpeed averages gradients
  over the ranks as FSDP2 does, and Relay's losses are divided by whole-batch counts and
  multiplied by the world size (``MicroBatches.grad_scale``), so the sum over passes and
  ranks is the gradient of the mini-batch's loss;
- step: ``engine.step()`` once per mini-batch clips the global gradient norm to
  ``actor.grad_clip`` (DeepSpeed's ``gradient_clipping``), skips a step whose norm is not
  finite (as ``relay.learner.optim.clipped_step`` does), and steps Relay's AdamW
  (``relay.learner.optim.build_optimizer``) on this rank's partition. The schedule stays
  Relay's: a ``LambdaLR`` on the same parameter groups, stepped once per learner step;
- state: the full fp32 parameters and Adam moments by parameter name
  (``deepspeed.utils.safe_get_full_*``), in the layout ``get_state_dict`` gives for an
  FSDP2 model, so a checkpoint is the DCP state FSDP2 writes and a run resumes under either
  strategy at any world size (each rank holds the full state while it is written).

With ``model.dtype = bfloat16`` the engine computes in bf16 with fp32 master weights and
fp32 gradient reduction, as FSDP2's mixed precision does. ZeRO-3 gathers the whole policy on
every rank for a weight publish or a Hugging Face export (``gathered``): its memory is
the model's once more for that moment.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from transformers import AutoModelForCausalLM

from relay.configs.run_schema import DeepSpeedConfig, RunConfig
from relay.learner.attention import ATTENTION
from relay.learner.model import enable_activation_checkpointing
from relay.learner.optim import build_optimizer

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def import_deepspeed() -> ModuleType:
    """``deepspeed``, or an ``ImportError`` that says how to install it."""
    try:
        return importlib.import_module("deepspeed")
    except ImportError as exc:
        raise ImportError("actor.strategy = \"deepspeed\" needs DeepSpeed: pip install "
                          "'relay-rl[deepspeed]' (or set actor.strategy = \"fsdp2\")") from exc


def engine_config(settings: DeepSpeedConfig, *, grad_clip: float,
                  dtype: torch.dtype) -> dict[str, Any]:
    """The DeepSpeed config of the policy's engine. Batch sizes are DeepSpeed's bookkeeping
    only: Relay cuts the passes and sets the accumulation boundary itself."""
    zero: dict[str, Any] = {"stage": settings.zero_stage}
    if settings.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if settings.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "communication_data_type": "fp32",
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_allow_untested_optimizer": True,  # Relay's AdamW: torch's, fused on the CPU
        "zero_force_ds_cpu_optimizer": False,  # ...offloaded too, instead of DeepSpeedCPUAdam
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def load_zero_policy(run: RunConfig, device: torch.device) -> ZeroEngine:
    """The run's policy (``model.path``) in a ZeRO engine with Relay's AdamW: read whole by
    every rank in fp32 (the engine then keeps this rank's partition; ZeRO-3 frees the
    rest), attending with ``relay.learner.attention`` as FSDP2's policy does."""
    model = AutoModelForCausalLM.from_pretrained(
        run.model.path, dtype=torch.float32, attn_implementation=ATTENTION,
        trust_remote_code=run.model.trust_remote_code).to(device)
    model.config.use_cache = False
    if run.model.enable_gradient_checkpointing:
        enable_activation_checkpointing(model)
    return ZeroEngine(model, build_optimizer(model, run.actor.optim), run.actor.deepspeed,
                      grad_clip=run.actor.grad_clip, dtype=getattr(torch, run.model.dtype))


class EngineForward:
    """The engine as the learner's passes call a model (``relay.learner.model.
    forward_logprobs``): the model's transformers ``config`` and the engine's forward. It
    has no separate head (``get_output_embeddings`` is None), so the passes run the
    model's own forward (``relay.learner.logprob_head.linear_head``)."""

    def __init__(self, engine: nn.Module) -> None:
        self.engine = engine
        self.config = engine.module.config

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def get_output_embeddings(self) -> None:
        return None


class ZeroEngine:
    """The policy inside a DeepSpeed ZeRO engine: ``policy`` forwards (``EngineForward``),
    ``backward`` takes each pass's loss, ``step`` steps once per mini-batch; ``module`` is
    the model itself (its parameter names are the policy's)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 settings: DeepSpeedConfig, *, grad_clip: float, dtype: torch.dtype) -> None:
        deepspeed = import_deepspeed()
        if not dist.is_initialized():
            raise RuntimeError("actor.strategy = \"deepspeed\": the learner's process group "
                               "must be initialised before the engine")
        self.settings = settings
        self.low_precision = dtype != torch.float32  # bf16 modules over fp32 masters
        self.optimizer = optimizer  # the client AdamW: its param groups hold the schedule's lr
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer,
            config=engine_config(settings, grad_clip=grad_clip, dtype=dtype))
        self.policy = EngineForward(self.engine)
        self._zero = deepspeed.zero
        self._utils = importlib.import_module("deepspeed.utils")

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        """Accumulate one pass's gradient; ``last``: the mini-batch's last pass, after which
        the gradients are reduced to their partitions."""
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        """Clip, step (unless the norm is not finite) and clear the gradients; the global
        gradient norm before clipping."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    @contextlib.contextmanager
    def gathered(self, *, modify: bool = False) -> Iterator[None]:
        """The full parameters in the module for the block (ZeRO-3; ZeRO-2 holds them);
        ``modify``: what rank 0 writes into them is partitioned again at its end."""
        if self.settings.zero_stage != 3:
            yield
            return
        with self._zero.GatheredParameters(list(self.module.parameters()),
                                           modifier_rank=0 if modify else None):
            yield

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The model's and the optimizer's state by parameter name, as ``get_state_dict``
        gives them for an FSDP2 model (full tensors on every rank; a collective)."""
        self._create_state()
        utils, group = self._utils, self.optimizer.param_groups[0]
        model_state: dict[str, torch.Tensor] = {}
        optim_state: dict[str, dict[str, torch.Tensor]] = {}
        step = self._step_count()
        for name, param in self.module.named_parameters(remove_duplicate=False):
            model_state[name] = utils.safe_get_full_fp32_param(param).detach().clone()
        for name, param in self.module.named_parameters():  # a tied weight once, as FSDP2's
            if not param.requires_grad:
                continue
            entry = {"step": torch.tensor(float(step))}
            for key in ADAM_MOMENTS:
                entry[key] = utils.safe_get_full_optimizer_state(param, key).detach().clone()
            optim_state[name] = entry
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [name for name, param in self.module.named_parameters()
                              if param.requires_grad]}]
        return model_state, {"state": optim_state, "param_groups": groups}

    def load_full_state(self, model_state: dict[str, torch.Tensor],
                        optim_state: dict[str, Any]) -> None:
        """Put ``full_state``'s layout back (each rank takes its partition; a collective)."""
        utils = self._utils
        self._create_state()
        with torch.no_grad(), self.gathered(modify=True):  # the weights the passes compute with
            for name, param in self.module.named_parameters():
                param.copy_(model_state[name].to(param.dtype))
        step = None
        for name, param in self.module.named_parameters():  # the optimizer's fp32 masters
            utils.safe_set_full_fp32_param(param, model_state[name])
            entry = optim_state["state"].get(name)
            if entry is None or not param.requires_grad:
                continue
            for key in ADAM_MOMENTS:
                utils.safe_set_full_optimizer_state(param, entry[key], key)
            step = entry["step"]
        if step is not None:
            self._set_step_count(step)

    def _create_state(self) -> None:
        """Create Adam's state if no step has, as it would be before the first: it exists
        only after a step, and DeepSpeed links it to the parameters then. One step on the
        zero gradient of a one-token forward at learning rate and weight decay 0 (no weight
        moves, the moments stay 0), its count then set back to 0."""
        if self.optimizer.state:
            return
        groups = self.optimizer.param_groups
        configured = [(group["lr"], group["weight_decay"]) for group in groups]
        for group in groups:
            group["lr"] = group["weight_decay"] = 0.0
        device = self.engine.device
        logits = self.engine(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device)).logits
        self.backward(logits.float().sum() * 0.0, last=True)
        self.step()
        for group, (lr, weight_decay) in zip(groups, configured):
            group["lr"], group["weight_decay"] = lr, weight_decay
        self._set_step_count(torch.tensor(0.0))

    def _step_count(self) -> int:
        """Adam's step count (the same for every partition: one per optimizer step)."""
        for state in self.optimizer.state.values():
            if "step" in state:
                return int(state["step"])
        return 0

    def _set_step_count(self, step: torch.Tensor) -> None:
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.as_tensor(step, dtype=state["step"].dtype,
                                                device=state["step"].device).clone()
