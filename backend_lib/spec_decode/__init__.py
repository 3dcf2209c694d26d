"""Speculative decoding: proposers (n-gram prompt lookup, DeepSeek MTP) and the rejection sampler that verifies
their drafts losslessly (rejection.py)."""
