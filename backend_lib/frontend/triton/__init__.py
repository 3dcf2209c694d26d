"""Triton: ``codec.py`` (request tensors and parameters -> plain values -> the engine's intake, Triton-free),
``responses.py`` (engine outputs -> response tensors), ``parameters.py`` (config.pbtxt parameters -> the engine's
config), ``metrics.py`` (pb_utils metric families), and the launcher: ``server.py`` (``deepinfer serve``),
``install.py`` (where tritonserver and the model repository come from), ``lifeline.py`` (nothing outlives the
launcher), ``shutdown.py`` (its signals)."""
