"""The GPU validation kit: one command that exercises the CUDA path end to end on one GPU.

``python -m bpo_megatron.gpu_smoke --out DIR`` runs every check of :mod:`.checks` in its own
process (a CUDA fault in one cannot take the others down; Megatron's global state starts fresh),
writes ``DIR/report.json`` and ``DIR/report.md`` after each one, and exits 1 if any failed. With
``--device cpu`` the same checks run on a tiny model (CI runs it that way, so the kit does not rot
between GPU runs). See docs/gpu-validation.md.
"""
