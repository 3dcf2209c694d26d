"""DeepSeek-V4.1 (``model_type: deepseek_v41``): CSA2 attention with shared compressed KV and the candidate pool,
single-pass mHC, the V4.1 router, in the release's own tensor names. ``config`` reads the composite config.json;
the design notes are ``../shared/design/DEEPSEEK_V41.md``."""
