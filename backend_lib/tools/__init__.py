"""Offline tools, never on the serving path: ``tiny.py`` (``deepinfer make-tiny``: tiny random models for tests
and demos), ``lint/`` (``deepinfer lint-graphs``: every compiled region checked for what neuronx-cc rejects) and
``layout.py`` (per-rank weights, KV and collectives at a given tensor-parallel size). They may import anything
below the frontend."""
