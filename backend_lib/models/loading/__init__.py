"""Checkpoint loading: GGUF and safetensors files into a model class, and the options a model class reads."""
