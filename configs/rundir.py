"""A process's view of its run: the run directory, both resolved configs, addresses, keys.

The launcher (``tools/launcher``) writes the resolved ``topology.toml`` and ``run.toml``
into the run directory; the buffer, learner and generators read them back here with
``load_run_dir``, so every process of a run sees the same configuration. Addresses, CURVE
keys, the checkpoint folder and the checkpoint a run resumes from are derived from the
configs in one place. This module reads files; it parses no command line and starts
nothing.

Keys folder layout (``tools/make-curve-keys.py`` writes it): ``server.key`` /
``server.key_secret`` for every binding process, ``client.key`` / ``client.key_secret`` for
every connecting one, and ``authorized/`` holding the public keys servers accept.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

from configs.checks import load_run_config, load_topology
from configs.loader import ConfigError
from configs.run_schema import RunConfig
from configs.topology_schema import Topology
from transport.endpoints import tcp_endpoint
from transport.security import ClientKeys, ServerKeys, load_keypair, load_public_key

RESOLVED_TOPOLOGY = "topology.toml"  # file names inside a run directory
RESOLVED_RUN = "run.toml"


class RunContext(msgspec.Struct, kw_only=True, frozen=True):
    """A process's view of its run."""

    run_dir: Path
    topology: Topology
    run: RunConfig

    @property
    def buffer_endpoint(self) -> str:
        return tcp_endpoint(self.topology.buffer.host, self.topology.buffer.port)

    @property
    def weights_endpoint(self) -> str:
        learner = self.topology.learner
        return tcp_endpoint(learner.hosts[0], learner.weights_port)

    @property
    def weights_stream_endpoint(self) -> str:
        learner = self.topology.learner
        return tcp_endpoint(learner.hosts[0], learner.weights_stream_port)

    @property
    def metrics_endpoint(self) -> str:
        launcher = self.topology.launcher
        return tcp_endpoint(launcher.host, launcher.metrics_port)

    @property
    def checkpoint_dir(self) -> Path:
        return checkpoint_dir(self.run, self.run_dir)

    @property
    def resume_from(self) -> Path | None:
        """The checkpoint folder this run resumes from, or None for a fresh start. The
        launcher resolves ``trainer.resume_mode = "auto"`` before any process starts."""
        trainer = self.run.trainer
        if trainer.resume_mode == "auto":
            raise ConfigError(str(self.run_dir / RESOLVED_RUN), "trainer.resume_mode",
                              "'auto' must be resolved by tools/launch-cluster.py into "
                              "'resume_path' or 'disable' before the run's processes start")
        return Path(trainer.resume_from_path) if trainer.resume_mode == "resume_path" else None

    def server_keys(self) -> ServerKeys | None:
        keys = self._keys_dir()
        if keys is None:
            return None
        return ServerKeys(keypair=load_keypair(keys / "server.key_secret"),
                          authorized_clients=keys / "authorized")

    def client_keys(self) -> ClientKeys | None:
        keys = self._keys_dir()
        if keys is None:
            return None
        return ClientKeys(keypair=load_keypair(keys / "client.key_secret"),
                          server_public_key=load_public_key(keys / "server.key"))

    def _keys_dir(self) -> Path | None:
        security = self.topology.security
        return Path(security.keys_dir) if security.curve else None


def checkpoint_dir(run: RunConfig, run_dir: Path) -> Path:
    """Where a run's checkpoints go: ``checkpoint.dir``, or ``run_dir/checkpoints``."""
    return run_dir.joinpath(run.checkpoint.dir) if run.checkpoint.dir else run_dir / "checkpoints"


def is_run_dir(folder: Path) -> bool:
    """Whether ``folder`` holds the resolved configs the launcher writes."""
    return (folder / RESOLVED_RUN).is_file() and (folder / RESOLVED_TOPOLOGY).is_file()


def load_run_dir(run_dir: str | Path) -> RunContext:
    """The run's resolved configs, checked as any config file is (``ConfigError``)."""
    run_dir = Path(run_dir).resolve()
    return RunContext(run_dir=run_dir, topology=load_topology(run_dir / RESOLVED_TOPOLOGY),
                      run=load_run_config(run_dir / RESOLVED_RUN))


LOG_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"


def configure_logging() -> None:
    """Every process of a run logs lines in one format, at ``RELAY_LOG_LEVEL`` (INFO)."""
    logging.basicConfig(level=os.environ.get("RELAY_LOG_LEVEL", "INFO"), format=LOG_FORMAT)
