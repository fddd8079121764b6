"""Data from outside: files read out of PyPI wheels, the hub, the training prompts and the benchmark workloads."""
