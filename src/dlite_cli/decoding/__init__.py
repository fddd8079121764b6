"""Speculative decoding: the drafters and copying proposers, the adaptive draft length, the batched engine and its memory plan."""
