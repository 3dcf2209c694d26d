"""Model definitions (registry.py maps architecture names to classes) and checkpoint loading (loader.py)."""
