"""A process's view of its run: the run directory, both resolved configs, addresses, keys.

The launcher (``tools/launcher``) writes the resolved ``topology.toml`` and ``run.toml``
into the run directory; the buffer, learner and generators read them back here with
``load_run_dir``, so every process of a run sees the same configuration. Addresses, CURVE
keys, the checkpoint folder and the checkpoint a run resumes from are derived from the
configs in one place. This module reads files; it parses no command line and starts
nothing.

Addresses: with CURVE, ``tcp://host:port`` from the topology. Without CURVE every process
is on this machine (``relay.configs.checks``), and a loopback port would let any local user act
as the learner, or read every pending prompt with its ground truth; so each address is an
``ipc://`` file in the run's sockets folder (``Topology.security.sockets_dir``, by default
``RUN_DIR/sockets``), which the launcher makes 0700 and this user's before any process
starts (``relay.launcher.plan``): only this user's processes can connect to, or bind, those files.

Keys folder layout (``tools/make-curve-keys.py`` writes it): ``server.key`` /
``server.key_secret`` for every binding process, ``client.key`` / ``client.key_secret`` for
every connecting one, and ``authorized/`` holding the public keys servers accept.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

from relay.configs.checks import load_run_config, load_topology
from relay.configs.loader import ConfigError
from relay.configs.run_schema import RunConfig
from relay.configs.topology_schema import Topology
from relay.transport.endpoints import ipc_endpoint, is_loopback, tcp_endpoint
from relay.transport.security import ClientKeys, ServerKeys, load_keypair, load_public_key

RESOLVED_TOPOLOGY = "topology.toml"  # file names inside a run directory
RESOLVED_RUN = "run.toml"
VERL_KEYS = "verl-keys.txt"  # what each verl key of the launch became (relay.launch)
FINAL_MODEL = "final"  # the trained policy as a Hugging Face folder (relay.learner.hf_export)
SOCKETS = "sockets"  # the default sockets folder, inside the run directory
SOCKET_NAMES = ("buffer", "weights", "weights-stream", "metrics")
"""The ipc socket files of a run without CURVE, one per bound address; each reward server
(``[[reward_models]]``) adds one of its own (``reward_socket_name``)."""


def reward_socket_name(name: str) -> str:
    """The ipc socket file of the reward server ``name`` (``[[reward_models]]``)."""
    return f"rm-{name}"


def socket_names(topology: Topology) -> tuple[str, ...]:
    """Every ipc socket file of a run of ``topology`` without CURVE."""
    return (*SOCKET_NAMES, *(reward_socket_name(r.name) for r in topology.reward_models))


class RunContext(msgspec.Struct, kw_only=True, frozen=True):
    """A process's view of its run."""

    run_dir: Path
    topology: Topology
    run: RunConfig

    @property
    def buffer_endpoint(self) -> str:
        return self._endpoint("buffer", self.topology.buffer.host, self.topology.buffer.port)

    @property
    def weights_endpoint(self) -> str:
        learner = self.topology.learner
        return self._endpoint("weights", learner.hosts[0], learner.weights_port)

    @property
    def weights_stream_endpoint(self) -> str:
        learner = self.topology.learner
        return self._endpoint("weights-stream", learner.hosts[0], learner.weights_stream_port)

    @property
    def metrics_endpoint(self) -> str:
        launcher = self.topology.launcher
        return self._endpoint("metrics", launcher.host, launcher.metrics_port)

    @property
    def reward_endpoints(self) -> list[str]:
        """The address of each reward server (``[[reward_models]]``), in topology order;
        empty when the generators score inside themselves."""
        return [self._endpoint(reward_socket_name(r.name), r.host, r.port)
                for r in self.topology.reward_models]

    def reward_endpoint(self, name: str) -> str:
        """The address the reward server ``name`` binds; ``KeyError`` for no such server."""
        placements = {r.name: r for r in self.topology.reward_models}
        placement = placements[name]
        return self._endpoint(reward_socket_name(name), placement.host, placement.port)

    @property
    def sockets_dir(self) -> Path | None:
        """The private folder of the run's ipc sockets, or None when it talks over tcp."""
        return sockets_dir(self.topology, self.run_dir)

    def _endpoint(self, name: str, host: str, port: int) -> str:
        folder = self.sockets_dir
        return tcp_endpoint(host, port) if folder is None else ipc_endpoint(folder / name)

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


def uses_ipc(topology: Topology) -> bool:
    """Whether the run's addresses are ipc files (module docstring): no CURVE, and every
    process (buffer, learner ranks, generators, evaluator, launcher) on this machine."""
    hosts = [topology.buffer.host, *topology.learner.hosts, topology.evaluator.host,
             topology.launcher.host, *(g.host for g in topology.generators),
             *(r.host for r in topology.reward_models)]
    return not topology.security.curve and all(is_loopback(host) for host in hosts)


def sockets_dir(topology: Topology, run_dir: Path) -> Path | None:
    """The folder of the ipc sockets of a run that ``uses_ipc`` (else None):
    ``security.sockets_dir`` (absolute once loaded: ``relay.configs.checks`` resolves it against
    the topology file), by default ``run_dir/sockets``."""
    if not uses_ipc(topology):
        return None
    return run_dir.joinpath(topology.security.sockets_dir or SOCKETS)


def longest_socket_path(folder: Path, names: tuple[str, ...] = SOCKET_NAMES) -> int:
    """The length of the longest socket path of a run in ``folder`` (its socket files
    ``names``: ``socket_names``); at most ``IPC_PATH_MAX`` fits a Unix socket."""
    return max(len(str(folder / name)) for name in names)


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
