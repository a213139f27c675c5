"""Baselines the benchmarks run as a user would: standalone scripts that import nothing from esm_turbo."""
