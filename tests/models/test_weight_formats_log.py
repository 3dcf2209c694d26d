"""The load log of ``weight_format=packed`` names every packed tensor group with its bytes: the projections per
format and the routed experts kept packed (DeepSeek-V3's fp8 tiles, V4's fp4 tiles), whose bytes the resident
total already counted."""
from __future__ import annotations

import logging
import re

import pytest

from backend_lib.models.deepseek_v3.moe import RoutedExperts
from backend_lib.models.deepseek_v4.layers import V4MoE
from backend_lib.models.layers import describe_weight_formats, resident_weight_bytes
from backend_lib.models.loading.loader import load_model
from backend_lib.tools.tiny import make_tiny


def _load_logged(path, caplog) -> tuple[object, str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="backend_lib.models.loading.loader"):
        model = load_model(str(path), progress=False, weight_format="packed")
    [line] = [r.getMessage() for r in caplog.records if "weight_format=packed" in r.getMessage()]
    return model, line


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def test_v3_fp8_experts_kept_packed_are_named_with_their_bytes(tmp_path, caplog):
    path = make_tiny("deepseek_v3", tmp_path / "v3", fp8=True, mtp_layers=1)
    model, line = _load_logged(path, caplog)
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]  # the MoE layers' and the MTP layer's
    assert len(experts) >= 2 and all(m.packed_experts() is not None for m in experts)
    counts = [m.packed_experts_bytes() for m in experts]
    weights, nbytes = sum(c[0] for c in counts), sum(c[1] for c in counts)
    per_layer = experts[0].num_experts
    group = f"fp8_e4m3 routed experts {len(experts)} layers x {per_layer} experts {_mb(nbytes)}"
    assert f"{group} {nbytes / weights:.3f} B/w" in line, line
    # The projections' group too, with its own bytes; the two groups are all the packed bytes there are.
    projections = [m.quantized for m in model.modules() if getattr(m, "quantized", None) is not None]
    proj_bytes = sum(q.nbytes for q in projections)
    assert f"fp8_e4m3 {len(projections)} projections {_mb(proj_bytes)}" in line
    assert describe_weight_formats(model) in line
    total_weights, resident = resident_weight_bytes(model)
    assert f"{total_weights} weights in {resident / 1e6:.1f} MB resident" in line
    assert 1.0 < nbytes / weights < 1.01  # one byte a weight plus the 128x128 blocks' fp32 scales


def test_v4_fp4_experts_kept_packed_are_named_with_their_bytes(tmp_path, caplog):
    path = make_tiny("deepseek_v4", tmp_path / "v4", fp8=True, fp4_experts=True)
    model, line = _load_logged(path, caplog)
    moes = [m for m in model.modules() if isinstance(m, V4MoE) and m.packed_experts_summary() is not None]
    assert moes
    weights = sum(m.packed_experts_bytes()[0] for m in moes)
    nbytes = sum(m.packed_experts_bytes()[1] for m in moes)
    match = re.search(r"fp4_e2m1 routed experts (\d+) layers x (\d+) experts ([\d.]+ MB) ([\d.]+) B/w", line)
    assert match is not None, line
    assert (int(match[1]), int(match[2]), match[3]) == (len(moes), moes[0].num_local_experts, _mb(nbytes))
    assert float(match[4]) == pytest.approx(nbytes / weights, abs=5e-4)
    assert 0.5 < nbytes / weights < 0.6  # half a byte a weight plus an e8m0 scale per 32
    assert "fp8_e4m3" in line and "projections" in line  # V4's fp8 projections, packed too


def test_nothing_packed_says_so(tmp_path):
    model = load_model(str(make_tiny("deepseek_v3", tmp_path / "plain")), progress=False)
    assert describe_weight_formats(model) == "no quantized weights"
