"""DeepSeek-V4: sliding / CSA / HCA attention with the lightning indexer, mHC decoder layers, hash / top-k MoE, the MTP
depth."""
