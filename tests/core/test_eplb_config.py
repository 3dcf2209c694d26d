"""EPLB settings: defaults off, each bad value refused naming its setting, the parallel shape it needs."""
from __future__ import annotations

import pytest

from backend_lib.core.config import EngineConfig, config_to_flat
from backend_lib.frontend.triton.parameters import engine_config_from_parameters

EP2 = {"tensor_parallel_size": 2, "enable_expert_parallel": True}


def test_eplb_settings_round_trip_through_the_flat_form():
    config = EngineConfig.from_flat({**EP2, "enable_eplb": True, "num_redundant_experts": 2,
                                     "eplb_window_steps": 10, "eplb_interval_steps": 5})
    assert (config.eplb.enable_eplb, config.eplb.num_redundant_experts) == (True, 2)
    assert EngineConfig.from_flat(config_to_flat(config)).eplb == config.eplb


def test_eplb_settings_arrive_from_config_pbtxt_parameters():
    config = engine_config_from_parameters({"tensor_parallel_size": "2", "enable_expert_parallel": "true",
                                            "enable_eplb": "true", "eplb_interval_steps": "7"})
    assert config.eplb.enable_eplb and config.eplb.eplb_interval_steps == 7


@pytest.mark.parametrize("settings, message", [
    ({"enable_eplb": True}, "enable_eplb needs expert parallelism"),
    ({"enable_eplb": True, "tensor_parallel_size": 2}, "enable_eplb needs expert parallelism"),
    ({**EP2, "num_redundant_experts": 2}, "num_redundant_experts=2 needs enable_eplb"),
    ({**EP2, "enable_eplb": True, "num_redundant_experts": -1}, "num_redundant_experts must be >= 0"),
    ({**EP2, "enable_eplb": True, "eplb_window_steps": 0}, "eplb_window_steps must be >= 1"),
    ({**EP2, "enable_eplb": True, "eplb_interval_steps": 0}, "eplb_interval_steps must be >= 1"),
    ({**EP2, "enable_eplb": True, "compile_backend": "inductor"}, "enable_eplb runs eager steps"),
    ({**EP2, "enable_eplb": True, "context_parallel_size": 2}, "context_parallel_size=2"),
])
def test_bad_eplb_settings_name_the_setting(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_flat(settings)
