"""Relay's configuration: the typed schemas, the TOML loader and checks, the default configs.

It owns what a run is configured with: the topology schema (where processes run) and the
run schema, which composes each component's own config struct (the algorithm knobs are
defined beside their code in ``algorithms``; the buffer's, learner's and generators' here,
since those packages sit above this one), the loader with key-path errors and did-you-mean,
the cross-key checks, a process's view of its run directory (``rundir``), the default
TOMLs and the bundled data. It starts nothing and parses no command line.

``load_topology`` and ``load_run_config`` are the two entry points; both raise
``ConfigError`` naming the file, the key and the problem. The embedded default lives beside
this file: ``topology.toml`` (one buffer, one learner rank, one generator, the evaluator,
loopback) and ``arithmetic-grpo.toml`` (GRPO on the bundled arithmetic task).
"""

from pathlib import Path

from relay.configs.checks import load_run_config, load_topology
from relay.configs.loader import ConfigError
from relay.configs.run_schema import RunConfig
from relay.configs.topology_schema import Topology

CONFIG_DIR = Path(__file__).resolve().parent
DEFAULT_TOPOLOGY = CONFIG_DIR / "topology.toml"
DEFAULT_RUN = CONFIG_DIR / "arithmetic-grpo.toml"

__all__ = [
    "CONFIG_DIR",
    "ConfigError",
    "DEFAULT_RUN",
    "DEFAULT_TOPOLOGY",
    "RunConfig",
    "Topology",
    "load_run_config",
    "load_topology",
]
