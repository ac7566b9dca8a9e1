"""The launcher's machinery behind ``tools/launch-cluster.py``.

It owns turning a topology and a run config into running processes: ``resolve`` checks
both configs and plans the run directory, ``plan`` lists the processes (buffer, torchrun
learner, generators, evaluator) with their command lines, ``resources`` what each needs of
a node, ``supervisor`` starts them through a backend (``backends``: here or over ssh;
``ray_backend``; ``slurm`` in a job that ``slurm_job`` submits), watches them, restarts
dead generators and stops them all, ``status`` draws the live status line from the metrics
they push. What each process does is in its own package; the
launcher only builds the embedded default model (``relay.learner.tiny_model``) when a run asks
for it and it is not cached yet. Installed as the ``launcher`` package (see ``pyproject.toml``).
"""
