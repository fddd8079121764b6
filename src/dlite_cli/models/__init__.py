"""The models: the DLite drafter and its release format, the target (prepared, loaded and run), oneDNN-packed linears, CUDA graphs."""
