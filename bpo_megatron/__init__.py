"""bpo-megatron: RL post-training for Mixture-of-Experts LLMs on Megatron-Core.

The policy-loss family (BPO and its baselines) lives in :mod:`bpo_megatron.losses`, group
advantages in :mod:`bpo_megatron.algo`, tensor-parallel kernels in :mod:`bpo_megatron.ops`.
"""

__version__ = "0.1.0"
