"""DSpark and DFlash block drafters for Llama-family targets (DeepSpec's drafter directories)."""
