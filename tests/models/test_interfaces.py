"""Every served model class declares what it supports, its declaration matches the methods it brings, and a setting
that asks for a capability the model lacks is refused naming the setting."""
import pytest
import torch

from backend_lib.core.config import EngineConfig
from backend_lib.models.interfaces import ModelCapabilities, ServedModel, capabilities_of
from backend_lib.models.parallel import ParallelContext
from backend_lib.models.registry import get_model_class, supported_architectures
from backend_lib.worker.executor.rank import build_rank

# capability -> the method a model declaring it must bring
_METHODS = {"fp8_kv": "use_fp8_kv", "hybrid_cache": "hybrid_cache_shapes", "static_moe": "set_moe_impl", "host_packing": "pack_for_cpu", "cpu_attention": "use_cpu_attention",
            "greedy_head_screen": "greedy_token_ids", "rope_extension": "cover_positions"}


@pytest.mark.parametrize("architecture", supported_architectures())
def test_declared_capabilities_match_the_methods(architecture):
    cls = get_model_class(architecture)
    assert issubclass(cls, ServedModel) and "capabilities" in vars(cls), f"{cls.__name__} declares no capabilities"
    declared = capabilities_of(cls)
    for flag, method in _METHODS.items():
        assert getattr(declared, flag) == hasattr(cls, method), f"{cls.__name__}: {flag} vs its {method}"
    assert (declared.mtp == "ring") == hasattr(cls, "mtp_window"), cls.__name__
    # compiled regions gather Engram rows on the host before the graph
    assert not (declared.engram and declared.static_moe) or hasattr(cls, "engram_gather"), cls.__name__


def test_a_module_that_is_not_a_served_model_supports_nothing():
    assert capabilities_of(torch.nn.Linear(2, 2)) == ModelCapabilities()


def test_mtp_on_a_model_without_mtp_is_refused_naming_the_setting(tiny_llama_dir):
    config = EngineConfig.from_flat({"model": str(tiny_llama_dir), "max_model_len": 64, "num_blocks": 8,
                                     "method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match=r"spec_method 'mtp' needs a model that drafts with MTP layers.*"
                                         r"LlamaForCausalLM has none"):
        build_rank(config, ParallelContext())
