"""The embedded rollout engine: a transformers model sampled in-process (the CPU default).

Its spec (``spec.SPEC``) is what the rest of the system knows of it; the engine itself
(``engine.HFEngine``) imports transformers and is loaded only when built.
"""
