"""``deepinfer lint-graphs``: ``graph_lint.py`` (the torch.compile backend and its rules), ``regions.py`` (the
catalogue of regions on tiny models), ``ranks.py`` (every tensor-parallel rank lints its shard) and ``cli.py``
(the command)."""
