"""The vLLM rollout engine (optional; GPUs). Importing this package does not import vLLM: its
spec (``spec.SPEC``) and options are light, the engine (``engine.VLLMEngine``) loads vLLM when built."""
