"""``tools/gpu-check.py``'s machinery: the wheels a GPU machine lacks (``wheels``), what the
checks run on (``build``), the checks A, B and C (``learner_check``, ``weights_check``,
``cluster_check``), their records and summary (``report``), the command line (``cli``).
Not installed with Relay: ``tools/gpu-check.py`` puts ``tools/`` on the path."""
