"""Parallel layout of the trainer and Megatron-Core process-group set-up."""

from bpo_megatron.parallel.config import ParallelConfig

__all__ = ["ParallelConfig"]
