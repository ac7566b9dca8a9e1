"""The buffer: the hub process between generators and the learner (``-m relay.buffer.main``).

It owns prompt leasing from verl-schema datasets, the staleness gate (eta), admission of
rollout groups, the replay stores and filters (FIFO, prioritized replay, DAPO dynamic
sampling, PF-PPO), the rollout log and the registry of attached generators. It knows
nothing of models or tokens beyond the ids it is sent: it never runs a forward pass.
"""
