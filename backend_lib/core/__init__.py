"""Torch-free core: configuration, sampling parameters, requests and the typed step outputs the layers exchange,
the scheduler, sessions and the KV block bookkeeping (``kv_cache.py``, ``hybrid_kv.py``), plus the OS process
helpers every layer uses (``processes.py``). Bottom of backend_lib: it imports nothing above it and no torch
(tests/test_import_graph.py checks both)."""
