"""Relay: fully asynchronous, off-policy actor-learner RL post-training for Hugging Face LLMs.

One installed package, ``relay``, made of the repository's top-level folders (packaging maps
each into the namespace; in the repository they keep their place):

=====================  =====================  ===============================================
``relay.learner``      ``learner/``           the trainer: FSDP2, Ulysses, losses, checkpoints
``relay.generators``   ``generators/``        inference engines that stream rollouts
``relay.buffer``       ``buffer/``            the replay buffer process between the two
``relay.transport``    ``transport/``         ZeroMQ sockets, msgspec messages, CURVE keys
``relay.algorithms``   ``algorithms/``        advantages, losses, rewards, tasks
``relay.configs``      ``configs/``           config schemas, checks, the embedded default
``relay.launcher``     ``tools/launcher/``    the launcher's plan, supervisor, status line
``relay`` (commands)   ``tools/relay/``       the ``relay`` command and its subcommands
=====================  =====================  ===============================================
"""

from importlib import metadata

try:
    __version__ = metadata.version("relay-rl")
except metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"
