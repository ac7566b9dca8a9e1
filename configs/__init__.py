"""Relay's configuration: the typed schemas, the TOML loader and the default configs.

``load_topology`` and ``load_run_config`` are the two entry points; both raise
``ConfigError`` naming the file, the key and the problem. The embedded default lives beside
this file: ``topology.toml`` (one buffer, one learner rank, one generator, loopback) and
``arithmetic-grpo.toml`` (GRPO on the bundled arithmetic task).
"""

from pathlib import Path

from configs.checks import load_run_config, load_topology
from configs.loader import ConfigError
from configs.run_schema import RunConfig
from configs.topology_schema import Topology

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
