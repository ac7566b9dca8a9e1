"""Publishing weight versions: gather FSDP2 shards, cut them into buckets, serve them.

``gather_full_weights`` is a collective: every rank walks the parameters in the same order
and all-gathers one parameter at a time (never the whole model in flight); rank 0 keeps the
full tensors on the CPU in the engines' dtype. ``bucketize`` turns a version into a
``WeightManifest`` and ``WeightBucket`` messages of about ``bucket_bytes`` each. The
``WeightServer`` (rank 0, its own thread and socket) answers ``WeightRequest``s with the
newest version: the manifest then its buckets, or an empty manifest when the generator is
up to date. Swapping in a new version is one reference assignment, so a request in flight
streams one consistent version.

The same server answers the evaluator's ``EvalRequest``s from the evaluation queue
(``learner.eval_queue``), which holds the published versions offered for held-out
evaluation. A request frame over ``MAX_REQUEST_BYTES`` drops its sender's connection
before it is read. Who may fetch weights is decided by CURVE (``transport.security``): every
authorized key's holder (learner hosts, generator hosts, the evaluator) needs them, so the
server takes no roles. When its thread dies, ``publish`` raises ``ThreadDied`` naming it:
the learner stops rather than train on while no generator can get new weights.
"""

from __future__ import annotations

import logging

import msgspec
import torch
import torch.distributed as dist
from torch import nn

from learner.eval_queue import EvalQueue
from transport.messages import (
    ErrorReply,
    EvalRequest,
    Message,
    WeightBucket,
    WeightEntry,
    WeightManifest,
    WeightRequest,
)
from transport.security import ServerKeys
from transport.sockets import Server, ServerThread

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 << 20
MAX_REQUEST_BYTES = 1 << 20  # requests are small (a version number, an eval report)


def gather_full_weights(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every parameter whole, on rank 0 (other ranks get {}); call on every rank."""
    is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
            if is_rank0:
                out[name] = full.to(device="cpu", dtype=dtype).contiguous()
    return out


class PublishedVersion(msgspec.Struct, frozen=True):
    manifest: WeightManifest
    buckets: list[WeightBucket]


def bucketize(version: int, tensors: dict[str, torch.Tensor], step: int = 0,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> PublishedVersion:
    """Group tensors, in order, into buckets of about ``bucket_bytes``; ``step``: the
    learner step after which they were taken."""
    entries: list[WeightEntry] = []
    buckets: list[WeightBucket] = []
    names: list[str] = []
    chunk: list[torch.Tensor] = []
    size = total = 0

    def flush() -> None:
        nonlocal names, chunk, size
        if chunk:
            buckets.append(WeightBucket(version=version, index=len(buckets), names=names,
                                        tensors=chunk))
            names, chunk, size = [], [], 0

    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > bucket_bytes:
            flush()
        entries.append(WeightEntry(name=name, dtype=str(tensor.dtype).removeprefix("torch."),
                                   shape=list(tensor.shape), bucket=len(buckets)))
        names.append(name)
        chunk.append(tensor)
        size += nbytes
        total += nbytes
    flush()
    manifest = WeightManifest(version=version, entries=entries, num_buckets=len(buckets),
                              total_bytes=total, step=step)
    return PublishedVersion(manifest=manifest, buckets=buckets)


class WeightServer:
    """Serves the newest published version to generators, and the evaluation queue to the
    evaluator, from its own thread."""

    def __init__(self, endpoint: str, keys: ServerKeys | None = None,
                 evaluation: EvalQueue | None = None) -> None:
        self._latest: PublishedVersion | None = None
        self.evaluation = evaluation or EvalQueue()
        self._server = Server(endpoint, self._handle, keys=keys,
                              max_message_bytes=MAX_REQUEST_BYTES)
        self.endpoint = self._server.endpoint
        self._thread = ServerThread(self._server, name="weight-server")

    def start(self) -> WeightServer:
        self._thread.start()
        logger.info("serving weights on %s", self.endpoint)
        return self

    def publish(self, published: PublishedVersion) -> None:
        self._thread.raise_if_died()
        self._latest = published

    @property
    def latest(self) -> PublishedVersion | None:
        return self._latest

    @property
    def version(self) -> int:
        return self._latest.manifest.version if self._latest else 0

    # -- the server thread ---------------------------------------------------------------

    def _handle(self, msg: Message, _identity: bytes) -> list[Message]:
        if isinstance(msg, EvalRequest):
            return self.evaluation.handle(msg, self.version)
        if not isinstance(msg, WeightRequest):
            return [ErrorReply(code="unexpected", detail=f"the weight server does not take "
                                                         f"{type(msg).__name__}")]
        latest = self._latest
        if latest is None or latest.manifest.version <= msg.have_version:
            return [WeightManifest(version=self.version)]
        logger.debug("version %d to generator %s (it has %d)", latest.manifest.version,
                     msg.generator_id, msg.have_version)
        return [latest.manifest, *latest.buckets]

    def stop(self) -> None:
        self._thread.stop()
