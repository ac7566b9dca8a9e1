"""The algorithms: pure functions on tensors, each with its formula and paper.

It owns advantage estimators, policy-loss modes, value loss, KL estimators and
controllers, loss aggregation, off-policy corrections, reward shaping, PRIME's implicit
rewards, the verifiable reward functions and the bundled tasks, and the config structs
of those knobs (composed by ``relay.configs.run_schema``). It knows nothing of Relay's
processes, sockets, config files, models or ``torch.distributed``: tensors in, tensors out
(the processes it starts: the reward functions' worker, ``rewards.worker``, and the
sandbox that runs untrusted code, ``sandbox``: a warm pool of forked children).
"""
