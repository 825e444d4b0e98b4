"""Benchmarks that print figures (``python -m benchmarks.<name>``); their tests check what they compute, never a time."""
