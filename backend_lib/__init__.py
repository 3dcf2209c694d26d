"""DeepInfer's engine and fronts, one package per layer; a module imports its own layer and those below, never above:

frontend (Triton model codec and launcher, OpenAI front, CLI) -> tools (make-tiny, lint, layout) -> engine (requests
to text) -> worker (a step on the ranks) -> models (one folder per family) -> neuron (what is specific to the device
and its compiler: platform, compiled regions, static MoE) -> core (torch-free) -> structured_output (output
constraints) -> ``kernels`` (top-level).
tests/test_import_graph.py enforces the order and the absence of import cycles.
"""
