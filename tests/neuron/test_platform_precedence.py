"""The device's precedence (DEEPINFER_DEVICE, then the `device` setting, then detection) and the two fp8 limits."""
import pytest

from backend_lib.neuron.platform import detect_platform


def test_environment_over_setting_over_detection():
    cores = {"NEURON_RT_VISIBLE_CORES": "0"}
    assert detect_platform(cores, neuron_importable=True).device_type == "neuron"  # detected
    assert detect_platform(cores, neuron_importable=True, device="cpu").device_type == "cpu"  # the setting
    forced = detect_platform({**cores, "DEEPINFER_DEVICE": "neuron"}, neuron_importable=True, device="cpu")
    assert forced.device_type == "neuron"
    with pytest.raises(ValueError, match=r"^device must be one of"):
        detect_platform({}, neuron_importable=False, device="tpu")


def test_activation_and_kv_limits_per_device_and_one_override_for_both():
    neuron = detect_platform({"NEURON_RT_VISIBLE_CORES": "0"}, neuron_importable=True)
    host = detect_platform({}, neuron_importable=False)
    overridden = detect_platform({"DEEPINFER_NEURON_FP8_MAX": "200"}, neuron_importable=False)
    assert [(p.fp8_max, p.kv_fp8_max) for p in (neuron, host, overridden)] == [(240.0, 224.0), (448.0, 448.0),
                                                                               (200.0, 200.0)]
