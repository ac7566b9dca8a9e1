"""Publishing weight versions: gather FSDP2 shards, cut them into buckets, serve them.

``gather_full_weights`` is a collective: every rank walks the parameters in the same order
and all-gathers one parameter at a time (never the whole model in flight); rank 0 keeps the
full tensors on the CPU in the engines' dtype. ``bucketize`` turns a version into a
``WeightManifest`` and ``WeightBucket`` messages of about ``bucket_bytes`` each. The
``WeightServer`` (rank 0, its own thread and socket) answers ``WeightRequest``s with the
newest version: the manifest then its buckets, or an empty manifest when the generator is
up to date. Swapping in a new version is one reference assignment, so a request in flight
streams one consistent version.

It also serves held-out evaluation, which runs in its own process (``generators.evaluator``)
so that no learner step waits for it: the loop ``offer_evaluation``s the weights it had
after an evaluation step (usually the version it just published: no copy), the evaluator
takes the newest offer with an ``EvalRequest`` and hands its metrics back with the next
one, and the loop collects them with ``take_eval_reports``. An offer the evaluator had no
time to take is replaced by the next (logged as skipped).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import torch
import torch.distributed as dist
from torch import nn

from transport.messages import (
    ErrorReply,
    EvalReport,
    EvalRequest,
    Message,
    Shutdown,
    WeightBucket,
    WeightEntry,
    WeightManifest,
    WeightRequest,
)
from transport.security import ServerKeys
from transport.sockets import Server, ServerThread

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 << 20


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


class EvalOffer(msgspec.Struct, frozen=True):
    """Weights to evaluate: those after learner ``step``, at ``version``; ``weights`` None
    means the initial checkpoint (nothing trained yet), which the evaluator already holds."""

    step: int
    version: int
    weights: PublishedVersion | None


class WeightServer:
    """Serves the newest published version to generators, and offers to evaluate to the
    evaluator, from its own thread."""

    def __init__(self, endpoint: str, keys: ServerKeys | None = None) -> None:
        self._latest: PublishedVersion | None = None
        self.requests = 0
        self._lock = threading.Lock()  # the evaluation state below, shared with the loop
        self._offer: EvalOffer | None = None  # the newest offer, until the evaluator takes it
        self._reports: list[EvalReport] = []
        self._reported_through = -1  # the latest step any report measured
        self._evaluation_over = False
        self._longest_evaluation_s = 0.0
        self._handed_at = 0.0
        self._server = Server(endpoint, self._handle, keys=keys)
        self.endpoint = self._server.endpoint
        self._thread = ServerThread(self._server, name="weight-server")

    def start(self) -> WeightServer:
        self._thread.start()
        logger.info("serving weights on %s", self.endpoint)
        return self

    def publish(self, published: PublishedVersion) -> None:
        self._latest = published

    @property
    def latest(self) -> PublishedVersion | None:
        return self._latest

    @property
    def version(self) -> int:
        return self._latest.manifest.version if self._latest else 0

    # -- evaluation (called by the learner's loop) --------------------------------------

    def offer_evaluation(self, offer: EvalOffer) -> None:
        """Make ``offer`` the next weights to evaluate, replacing one not yet taken."""
        with self._lock:
            if self._offer is not None:
                logger.warning("the evaluator is busy: step %d will not be evaluated",
                               self._offer.step)
            self._offer = offer

    def take_eval_reports(self) -> list[EvalReport]:
        """The reports that arrived since the last call."""
        with self._lock:
            reports, self._reports = self._reports, []
        return reports

    def end_evaluation(self, last_step: int, min_wait_s: float = 120.0,
                       on_report: Callable[[EvalReport], None] | None = None
                       ) -> list[EvalReport]:
        """No more offers: wait until the evaluator has reported ``last_step`` (or for
        ``min_wait_s``, at least three times the longest evaluation so far), then tell it
        the run is over. Returns the reports that arrived meanwhile, each also passed to
        ``on_report`` as it arrives."""
        with self._lock:
            self._evaluation_over = True
            deadline = time.monotonic() + max(min_wait_s, 3 * self._longest_evaluation_s)
        reports: list[EvalReport] = []
        while time.monotonic() < deadline:
            for report in self.take_eval_reports():
                reports.append(report)
                if on_report is not None:
                    on_report(report)
            with self._lock:
                if self._reported_through >= last_step:
                    return reports
            time.sleep(0.1)
        logger.warning("no evaluation of step %d arrived in time: is the evaluator alive? "
                       "(its log is in the run directory's logs/)", last_step)
        return reports

    def _evaluation(self, msg: EvalRequest) -> list[Message]:
        with self._lock:
            if msg.report is not None:
                self._reports.append(msg.report)
                self._reported_through = max(self._reported_through, msg.report.step)
                self._longest_evaluation_s = max(self._longest_evaluation_s,
                                                 time.monotonic() - self._handed_at)
            offer = self._offer
            if offer is None or offer.step <= msg.after_step:
                if self._evaluation_over:
                    return [Shutdown(reason="the run is over")]
                return [WeightManifest(version=self.version, step=msg.after_step)]
            self._offer, self._handed_at = None, time.monotonic()
        if offer.weights is None:
            return [WeightManifest(version=offer.version, step=offer.step)]
        manifest = msgspec.structs.replace(offer.weights.manifest, step=offer.step)
        return [manifest, *offer.weights.buckets]

    # -- the server thread ---------------------------------------------------------------

    def _handle(self, msg: Message, _identity: bytes) -> list[Message]:
        if isinstance(msg, EvalRequest):
            return self._evaluation(msg)
        if not isinstance(msg, WeightRequest):
            return [ErrorReply(code="unexpected", detail=f"the weight server does not take "
                                                         f"{type(msg).__name__}")]
        self.requests += 1
        latest = self._latest
        if latest is not None and latest.manifest.version > msg.have_version:
            logger.debug("version %d to generator %s (it has %d)", latest.manifest.version,
                         msg.generator_id, msg.have_version)
        if latest is None or latest.manifest.version <= msg.have_version:
            return [WeightManifest(version=self.version)]
        return [latest.manifest, *latest.buckets]

    def stop(self) -> None:
        self._thread.stop()
