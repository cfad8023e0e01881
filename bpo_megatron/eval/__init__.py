"""Evaluation: Avg@k on held-out benchmarks and the best-checkpoint rule."""
