"""What is specific to AWS Neuron and its compiler, in one place: the platform (device, compile backend, fp8
limits, core binding: ``platform.py``), static-shape buckets and padding (``buckets.py``), compiled model regions
(``regions.py``) and their persistent cache (``compile_cache.py``), the fp8 rescale to the device's e4m3
(``fp8.py``), the static MoE's fixed-shape form (``static_moe.py``) and the graph lint's rules (``graph_lint.py``).
The same code runs on the host CPU (inductor or eager); the worker builds the sampler's region on top
(``worker/compiled_sampler.py``) and ``deepinfer lint-graphs`` (``tools/lint/``) runs the lint over tiny models."""
