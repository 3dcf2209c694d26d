"""What runs a step on the ranks: ``executor/`` (the driver's handle on its ranks: worker processes, the process
group, what each rank builds), the step channel to the workers, the model runner, the sampler, prompt logprobs,
speculative decoding (``spec_decode/``), KV cache sizing (``kv_sizing.py``), and ``compile/`` (the compiled-region
runtime: platform, buckets, regions, compile cache, fp8 for Neuron). It imports models, core and kernels."""
