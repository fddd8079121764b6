"""dlite: DLite history-free speculative decoding, from regenerated data to benchmark tables."""

__version__ = "0.1.0"
