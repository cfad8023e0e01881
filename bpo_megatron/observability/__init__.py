"""Run outputs: metrics (JSONL, mirrored to TensorBoard, Weights & Biases, MLflow), the per-step line and PNG curves."""
