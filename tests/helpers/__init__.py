"""Test helpers shared by the test packages (oracles, checkpoints, comparisons)."""
