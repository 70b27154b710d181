"""Benchmarks: peer baselines and measurements on real weight trajectories."""
