"""Benchmarks: step gap, handoff, end to end, memory (`omni-serving bench`)."""
