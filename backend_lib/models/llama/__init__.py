"""The Llama family (Llama, Mistral, SmolLM2): the architecture read from a config, the model, where each checkpoint
tensor goes."""
