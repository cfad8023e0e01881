"""The RL trainer: Megatron-Core model chunks, their optimizer and the training step."""
