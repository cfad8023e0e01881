"""Benchmarks shipped with the package (the scripts in benchmarks/ call these)."""
