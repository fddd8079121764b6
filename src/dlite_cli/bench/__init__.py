"""Measuring: the benchmark and its tables, the ablations, the profile at a target's real shapes."""
