"""Proposers: one file each, behind the small interface in base.py.

    base.py      Draft, ProposerSetup, Proposer (the interface), helpers the proposers share
    none.py      none: plain decoding, nothing proposed
    copying.py   the base of proposers that copy from token ids
    ngram.py     ngram: prompt lookup
    suffix.py    suffix: suffix decoding (arctic-inference's cache)
    model.py     the base of proposers that run a drafter checkpoint, and its round's cost
    dlite.py     a history-free checkpoint (dlite, parallel, scratch)
    history.py   a checkpoint that keeps a draft KV cache (history: the teacher)
    hybrid.py    a history-free checkpoint paired with a copying proposer (NAME+ngram, NAME+suffix)

Names map to them in decoding/methods.py.
"""
