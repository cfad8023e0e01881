"""Helpers for running code on several local gloo ranks (tests and benchmarks)."""

from bpo_megatron.testing.gloo_world import GlooWorldError, run_gloo_world

__all__ = ["GlooWorldError", "run_gloo_world"]
