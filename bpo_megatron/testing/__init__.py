"""What tests and benchmarks need beyond the product: random Hugging Face checkpoints."""
