"""Parallel layout of the trainer and Megatron-Core process-group set-up."""

from bpo_megatron.parallel.config import ParallelConfig
from bpo_megatron.parallel.state import destroy_parallel, initialize_parallel, layout_record

__all__ = ["ParallelConfig", "destroy_parallel", "initialize_parallel", "layout_record"]
