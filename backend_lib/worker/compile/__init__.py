"""The compiled-region runtime the engine runs (on Neuron, and on the host with ``compile_backend``): platform
choice, static-shape buckets, the compiled model and sampler regions, the persistent compile cache, fp8 rescale for
Neuron. The offline checks of these regions (``deepinfer lint-graphs``) live in ``backend_lib.tools.lint``."""
