"""How a weight version reaches vLLM's workers, chosen by where they run.

Relay keeps vLLM's engine core in the generator's process (``relay.generators.vllm_engine``); its
workers are in this process too when vLLM runs one of them (``distributed_executor_backend``
"uni", vLLM's choice for one device), and processes of their own otherwise (tensor or
pipeline parallel: "mp", "ray"). A version arrives here in host memory, in Hugging Face
names (``relay.generators.hf_layout.hf_tensors``); vLLM's ``load_weights`` fuses and
shards it itself.

- ``HostReload`` (CPU): ``collective_rpc("reload_weights")`` with the host tensors, passed by
  reference to the in-process worker.
- ``DeviceReload`` (a GPU, the worker in this process): the same call, each tensor copied to
  the worker's GPU as vLLM's loader reads it (one tensor on the GPU at a time, then a
  device-to-device copy into the weights).
- ``CudaIpcSender`` (GPUs, workers in their own processes): vLLM's weight-transfer API with
  its CUDA-IPC backend (``weight_transfer_config={"backend": "ipc"}`` at start, then
  ``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
  ``finish_weight_update``): chunk by chunk, each tensor copied to every worker's GPU, and
  vLLM's workers open the copies through CUDA IPC handles; only the handles cross vLLM's RPC
  queue (not pickled tensors). CUDA IPC cannot open a handle in the process that made it, so
  the in-process worker takes ``DeviceReload`` instead.

vLLM's NCCL backend (a broadcast group between a trainer's rank and the workers) is not
used: the learner streams versions to generators over Relay's own wire, and within one node
the generator hands them on over CUDA IPC.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from relay.generators.weight_chunks import chunks_of

IPC_CHUNK_BYTES = 1 << 29
"""Bytes of a version copied to each worker's GPU per ``update_weights`` call (0.5 GiB
beside vLLM's share of the GPU, ``gpu_memory_utilization``)."""

Named = Iterable[tuple[str, torch.Tensor]]
Share = Callable[[torch.Tensor], tuple]
"""A CUDA tensor's IPC rebuild arguments (``torch.multiprocessing.reductions.reduce_tensor``'s
second element, which vLLM's IPC engine passes to ``rebuild_cuda_tensor``)."""


class WeightTransferMissing(RuntimeError):
    """This vLLM has no weight-transfer API, which a GPU generator with workers in other
    processes needs."""


def executor_backend(llm: Any) -> str:
    """How vLLM runs its workers: "uni" (in this process), "mp", "ray", ... (its
    ``parallel_config.distributed_executor_backend``)."""
    backend = llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
    return backend if isinstance(backend, str) else getattr(backend, "__name__", str(backend))


def worker_devices(llm: Any) -> list[torch.device]:
    """The GPUs of vLLM's workers as this process sees them: cuda:0..world_size-1 (a worker's
    local rank is its GPU among the visible ones)."""
    world = llm.llm_engine.vllm_config.parallel_config.world_size
    return [torch.device("cuda", rank) for rank in range(world)]


def weight_sender(llm: Any, device: str) -> HostReload | DeviceReload | CudaIpcSender:
    """The way versions reach ``llm``'s workers on ``device`` (module docstring)."""
    if device == "cpu":
        return HostReload(llm)
    if executor_backend(llm) == "uni":
        return DeviceReload(llm, worker_devices(llm)[0])
    return CudaIpcSender(llm, worker_devices(llm))


def _reload(llm: Any, named: Named) -> None:
    llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=named,
                                                     is_checkpoint_format=True))


class HostReload:
    """vLLM's in-place reload from host tensors (its CPU worker is in this process)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def send(self, named: Named) -> None:
        _reload(self.llm, list(named))


class DeviceReload:
    """vLLM's in-place reload in this process, each tensor copied to ``device`` as it is
    read."""

    def __init__(self, llm: Any, device: torch.device) -> None:
        self.llm, self.device = llm, device

    def send(self, named: Named) -> None:
        _reload(self.llm, ((name, tensor.to(self.device)) for name, tensor in named))


def cuda_ipc_args(tensor: torch.Tensor) -> tuple:
    """``tensor``'s CUDA IPC rebuild arguments (``Share``)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(tensor)[1]


def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID, by which vLLM's IPC engine finds a worker's handle."""
    return str(torch.cuda.get_device_properties(device).uuid)


def ipc_update_info(names: list[str], copies: list[list[torch.Tensor]], uuids: list[str],
                    share: Share) -> dict:
    """vLLM's ``IPCWeightTransferUpdateInfo`` (unpacked) for one chunk: ``copies[i][g]`` is
    tensor ``names[i]`` on the GPU of UUID ``uuids[g]``; each tensor's handles map every
    worker GPU's UUID to the rebuild arguments of its copy there."""
    return {"names": names,
            "dtype_names": [str(c[0].dtype).removeprefix("torch.") for c in copies],
            "shapes": [list(c[0].shape) for c in copies],
            "ipc_handles": [{uuid: share(copy) for uuid, copy in zip(uuids, per_gpu,
                                                                     strict=True)}
                            for per_gpu in copies]}


class CudaIpcSender:
    """vLLM's CUDA-IPC weight transfer, driven from this process (module docstring). Raises
    ``WeightTransferMissing`` when this vLLM lacks the API or was started without
    ``weight_transfer_config``."""

    def __init__(self, llm: Any, devices: list[torch.device], *,
                 chunk_bytes: int = IPC_CHUNK_BYTES, share: Share = cuda_ipc_args,
                 uuid: Callable[[torch.device], str] = gpu_uuid) -> None:
        if not hasattr(llm, "init_weight_transfer_engine"):
            raise WeightTransferMissing(
                "this vLLM has no weight-transfer API (LLM.init_weight_transfer_engine), which "
                "a generator with vLLM workers in other processes (tensor_model_parallel_size "
                "> 1) needs on GPUs: install the vLLM Relay pins (0.32), or run one GPU per "
                "generator")
        self.llm, self.devices, self.chunk_bytes = llm, devices, chunk_bytes
        self._share, self._uuid = share, uuid
        try:
            llm.init_weight_transfer_engine({"init_info": {"packed": False}})
        except RuntimeError as error:
            raise WeightTransferMissing(
                f"vLLM refused to start its CUDA-IPC weight transfer ({error}); Relay starts "
                "vLLM with weight_transfer_config={'backend': 'ipc'} on GPUs: do not override "
                "it in engine_kwargs") from error

    def send(self, named: Named) -> None:
        """start_weight_update, one ``update_weights`` per chunk, finish_weight_update; each
        chunk's copies are freed once vLLM has loaded them."""
        uuids = [self._uuid(device) for device in self.devices]
        self.llm.start_weight_update()
        for chunk in chunks_of(named, self.chunk_bytes):
            copies = [[tensor.to(device) for device in self.devices] for _, tensor in chunk]
            self.llm.update_weights({"update_info": ipc_update_info(
                [name for name, _ in chunk], copies, uuids, self._share)})
            del copies
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()  # freed once the workers dropped their views
        self.llm.finish_weight_update()
