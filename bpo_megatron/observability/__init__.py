"""Run outputs: metrics (JSONL, TensorBoard), the per-step line and PNG curves."""
