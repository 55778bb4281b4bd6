"""Benchmarks (installed as ``kvshrink.benchmarks``); targets live here, not in timed tests."""
