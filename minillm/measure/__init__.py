"""The measuring tools every bench, lesson and the CLI share: one timer, one percentile rule (metrics.py), the
machine's description (hardware.py), interleaved pairs and saved results (harness.py), rooflines, workloads."""
