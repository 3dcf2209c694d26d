"""platform.py: device choice, env overrides and their errors; buckets.py: bucket lists and padding rules."""
from __future__ import annotations

import pytest
import torch

from backend_lib.neuron.buckets import BucketSpec, pad_decode, powers_of_two_up_to
from backend_lib.neuron.platform import detect_platform, parse_core_list
from kernels.attention_metadata import AttentionMetadata


def test_host_mode_without_torch_neuronx():
    p = detect_platform({"NEURON_RT_VISIBLE_CORES": "0-1"}, neuron_importable=False)
    assert (p.device_type, p.compile_backend, p.enforce_eager, p.visible_cores) == ("cpu", "inductor", False, ())
    assert p.torch_device == torch.device("cpu") and p.compiles


def test_neuron_when_importable_and_a_core_is_visible():
    p = detect_platform({"NEURON_RT_VISIBLE_CORES": "0,2-3"}, neuron_importable=True)
    assert (p.device_type, p.compile_backend, p.visible_cores, p.fp8_max) == ("neuron", "neuron", (0, 2, 3), 240.0)


def test_env_overrides_and_errors():
    assert detect_platform({"DEEPINFER_DEVICE": "cpu", "NEURON_RT_VISIBLE_CORES": "0"},
                           neuron_importable=True).device_type == "cpu"
    assert detect_platform({"DEEPINFER_COMPILE_BACKEND": "aot_eager"}, neuron_importable=False).compile_backend \
        == "aot_eager"
    assert not detect_platform({"DEEPINFER_ENFORCE_EAGER": "1"}, neuron_importable=False).compiles
    for env, match in (({"DEEPINFER_DEVICE": "tpu"}, "DEEPINFER_DEVICE"),
                       ({"DEEPINFER_DEVICE": "neuron"}, "torch_neuronx"),
                       ({"DEEPINFER_COMPILE_BACKEND": "xla"}, "DEEPINFER_COMPILE_BACKEND"),
                       ({"DEEPINFER_COMPILE_BACKEND": "neuron"}, "neuron device"),
                       ({"DEEPINFER_ENFORCE_EAGER": "maybe"}, "DEEPINFER_ENFORCE_EAGER")):
        with pytest.raises(ValueError, match=match):
            detect_platform(env, neuron_importable=False)
    with pytest.raises(ValueError, match="NEURON_RT_VISIBLE_CORES"):
        parse_core_list("3-1")


def test_bucket_lists_and_lookup():
    assert powers_of_two_up_to(32) == (1, 2, 4, 8, 16, 32) and powers_of_two_up_to(24) == (1, 2, 4, 8, 16, 24)
    spec = BucketSpec.build(max_num_seqs=24, max_model_len=2048, block_size=16, prefill_lengths=(64, 256))
    assert spec.block_table_widths == (8, 16, 32, 64, 128)
    assert (spec.batch_bucket(3), spec.batch_bucket(17), spec.batch_bucket(25)) == (4, 24, None)
    assert (spec.width_bucket(9), spec.prefill_bucket(65), spec.prefill_bucket(300)) == (16, 256, None)
    assert spec.max_graphs == 6 * 5 + 2 and spec.prefill_keys() == [(64, 8), (256, 16)]
    with pytest.raises(ValueError, match="strictly increasing"):
        BucketSpec((2, 1), (8,), (), 16)
    with pytest.raises(ValueError, match="largest block_table_width"):
        BucketSpec((1,), (2,), (64,), 16)


def test_decode_padding_routes_padded_rows_to_the_scratch_block():
    meta = AttentionMetadata(4, torch.tensor([9, 22]), 2, 1, torch.tensor([[2, 0], [5, 7]], dtype=torch.int32),
                             torch.tensor([6, 7], dtype=torch.int32), 0, [], [], torch.zeros(0, 0, dtype=torch.int32))
    step = pad_decode(torch.tensor([11, 12]), torch.tensor([5, 6]), meta, rows=4, width=4, scratch_block=10)
    assert step.num_real == 2 and step.input_ids.tolist() == [11, 12, 0, 0]
    assert step.meta.slot_mapping.tolist() == [9, 22, 40, 40]
    assert step.meta.decode_block_tables.tolist() == [[2, 0, 10, 10], [5, 7, 10, 10], [10] * 4, [10] * 4]
    assert step.meta.decode_seq_lens.tolist() == [6, 7, 1, 1]
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode(torch.tensor([11, 12]), torch.tensor([5, 6]), meta, rows=1, width=4, scratch_block=10)
