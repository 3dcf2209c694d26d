"""The Neuron execution layer: platform choice, buckets, compiled regions, graph lint, fp8 rescale."""
