"""Triton: ``codec.py`` (parameters and request tensors -> engine inputs, outputs -> response tensors, Triton-free),
``metrics.py`` (pb_utils metric families), and the launcher: ``server.py`` (``deepinfer serve``), ``install.py``
(where tritonserver and the model repository come from), ``lifeline.py`` (nothing outlives the launcher),
``shutdown.py`` (its signals)."""
