"""The learner: the process that trains the policy (``torchrun -m relay.learner.main``).

It owns the trained models (the policy, and where the algorithm has them the reference, the
critic and PRIME's implicit PRM), FSDP2 sharding, the update of each step, publishing
weight versions to the generators and offering them for evaluation, checkpoints and the
MLflow run. Batches come from the buffer (``relay.learner.buffer_link``); the loss formulas
come from ``algorithms``. It knows nothing of engines, decoding or leases: it never generates, and
held-out evaluation runs in the evaluator process (``relay.generators.evaluator``).
"""
