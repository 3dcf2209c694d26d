"""TritonMetrics: engine stats -> Triton metric families (the real /metrics is checked in tests/e2e).

pb_utils only exists inside Triton's Python-backend stub, so these tests pass a recording stand-in with the
same MetricFamily / Metric calls and the same rule Triton enforces: a counter never takes a negative step.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from backend_lib.core.outputs import EngineStats, RequestMetrics, RequestOutput, SpecSurvivalStats
from backend_lib.frontend.triton.metrics import TritonMetrics

LABELS = {"model": "deepinfer", "version": "1"}


class _Metric:
    def __init__(self, family: "_Family", labels: dict[str, str], buckets: list[float] | None = None) -> None:
        self.family, self.labels, self.value, self.observed = family, labels, 0.0, []

    def increment(self, value: float) -> None:
        if self.family.kind == _Family.COUNTER and value < 0:
            raise ValueError("counter increment must be non-negative")  # Triton rejects it too
        self.value += value

    def set(self, value: float) -> None:
        assert self.family.kind == _Family.GAUGE, f"set() on non-gauge {self.family.name}"
        self.value = value

    def observe(self, value: float) -> None:
        self.observed.append(value)


class _Family:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: list["_Family"] = []

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.kind, self.metrics = name, kind, []
        self.created.append(self)

    def Metric(self, labels: dict[str, str], **kwargs) -> _Metric:  # noqa: N802 (pb_utils' name)
        metric = _Metric(self, labels, **kwargs)
        self.metrics.append(metric)
        return metric


class _PbUtils:
    def __init__(self) -> None:
        self.MetricFamily = type("MetricFamily", (_Family,), {"created": []})

    def series(self, name: str) -> dict[tuple, tuple[str, float]]:
        """Every metric of family ``name``: frozen labels -> (kind, value)."""
        out = {}
        for fam in self.MetricFamily.created:
            if fam.name == name:
                for m in fam.metrics:
                    out[tuple(sorted(m.labels.items()))] = (fam.kind, m.value)
        assert out, f"no family {name}"
        return out

    def value(self, name: str, **labels: str) -> float:
        key = tuple(sorted({**LABELS, **labels}.items()))
        return self.series(name)[key][1]

    def kind(self, name: str) -> str:
        return next(iter(self.series(name).values()))[0]


def _stats(**spec) -> EngineStats:
    base = EngineStats(num_running=1, num_waiting=0, kv_blocks_total=64, kv_blocks_used=8, prefix_cache_queries=0,
                       prefix_cache_hits=0, num_prompt_tokens=10, num_generation_tokens=20,
                       num_computed_prompt_tokens=10, num_preemptions=0)
    return replace(base, **spec)


@pytest.fixture()
def pb() -> _PbUtils:
    return _PbUtils()


def test_spec_counters_and_gauges_follow_engine_stats(pb):
    metrics = TritonMetrics(pb, LABELS)
    metrics.refresh(_stats())  # no speculation yet: zeros, no per-position series
    assert pb.kind("deepinfer_spec_decode_draft_tokens_total") == "counter"
    assert pb.kind("deepinfer_spec_decode_accepted_tokens_total") == "counter"
    assert pb.kind("deepinfer_spec_decode_num_drafts_total") == "counter"
    assert pb.kind("deepinfer_spec_decode_acceptance_rate") == "gauge"
    assert pb.kind("deepinfer_spec_decode_mean_accepted_length") == "gauge"
    assert pb.value("deepinfer_spec_decode_draft_tokens_total") == 0
    assert pb.value("deepinfer_spec_decode_mean_accepted_length") == 0
    assert not [f for f in pb.MetricFamily.created
                if f.name == "deepinfer_spec_decode_acceptance_rate_per_position" and f.metrics]

    # 4 drafts of 3 tokens: 12 verified, 7 accepted (4 at position 0, 2 at 1, 1 at 2).
    stats = _stats(spec_draft_tokens=12, spec_accepted_tokens=7, spec_num_drafts=4,
                   spec_drafts_per_position=[4, 4, 4], spec_accepted_per_position=[4, 2, 1])
    metrics.refresh(stats)
    assert pb.value("deepinfer_spec_decode_draft_tokens_total") == 12
    assert pb.value("deepinfer_spec_decode_accepted_tokens_total") == 7
    assert pb.value("deepinfer_spec_decode_num_drafts_total") == 4
    assert pb.value("deepinfer_spec_decode_acceptance_rate") == pytest.approx(7 / 12)
    assert pb.value("deepinfer_spec_decode_mean_accepted_length") == pytest.approx(1 + 7 / 4)
    family = "deepinfer_spec_decode_acceptance_rate_per_position"
    assert pb.kind(family) == "gauge"
    assert [pb.value(family, position=str(j)) for j in range(3)] == pytest.approx([1.0, 0.5, 0.25])
    # the lengths the proposer chose: twice none (drafting off), four times 3
    metrics.refresh(_stats(spec_draft_tokens=12, spec_chosen_lengths=[2, 0, 0, 4]))
    metrics.refresh(_stats(spec_draft_tokens=12, spec_chosen_lengths=[2, 0, 0, 4]))
    family = "deepinfer_spec_decode_chosen_length_total"
    assert pb.kind(family) == "counter"
    assert [pb.value(family, length=str(n)) for n in range(4)] == [2, 0, 0, 4]

    # Same snapshot again: counters do not double count.
    metrics.refresh(stats)
    assert pb.value("deepinfer_spec_decode_draft_tokens_total") == 12


def test_counters_advance_by_deltas_and_never_go_down(pb):
    metrics = TritonMetrics(pb, LABELS)
    for drafts, generated in ((3, 20), (9, 25), (9, 25), (15, 40)):
        metrics.refresh(_stats(spec_draft_tokens=drafts, num_generation_tokens=generated))
    assert pb.value("deepinfer_spec_decode_draft_tokens_total") == 15
    assert pb.value("deepinfer_generation_tokens_total") == 40

    # A smaller total (a restarted engine) adds nothing and raises nothing; growth past the old total counts.
    metrics.refresh(_stats(spec_draft_tokens=2, num_generation_tokens=5))
    assert pb.value("deepinfer_spec_decode_draft_tokens_total") == 15
    metrics.refresh(_stats(spec_draft_tokens=18, num_generation_tokens=41))
    assert pb.value("deepinfer_spec_decode_draft_tokens_total") == 18
    assert pb.value("deepinfer_generation_tokens_total") == 41


def test_per_position_gauges_grow_with_the_positions_reported(pb):
    metrics = TritonMetrics(pb, LABELS)
    metrics.refresh(_stats(spec_draft_tokens=2, spec_accepted_tokens=1, spec_num_drafts=2,
                           spec_drafts_per_position=[2], spec_accepted_per_position=[1]))
    metrics.refresh(_stats(spec_draft_tokens=6, spec_accepted_tokens=3, spec_num_drafts=4,
                           spec_drafts_per_position=[4, 2], spec_accepted_per_position=[3, 0]))
    family = "deepinfer_spec_decode_acceptance_rate_per_position"
    assert len(pb.series(family)) == 2  # one series per position, created once
    assert pb.value(family, position="0") == pytest.approx(0.75)
    assert pb.value(family, position="1") == 0.0


def test_dspark_survival_calibration_gauges(pb):
    metrics = TritonMetrics(pb, LABELS)
    metrics.refresh(_stats())  # no block drafter: no series
    assert not [f for f in pb.MetricFamily.created if f.name.endswith("_survival_per_position") and f.metrics]
    metrics.refresh(_stats(spec_survival=SpecSurvivalStats([0.9], [0.8])))
    metrics.refresh(_stats(spec_survival=SpecSurvivalStats([0.9, 0.5], [0.75, 0.5])))
    predicted, observed = ("deepinfer_spec_decode_predicted_survival_per_position",
                           "deepinfer_spec_decode_observed_survival_per_position")
    assert pb.kind(predicted) == pb.kind(observed) == "gauge"
    assert len(pb.series(predicted)) == 2  # one series per position, created once
    assert [pb.value(predicted, position=str(j)) for j in range(2)] == pytest.approx([0.9, 0.5])
    assert [pb.value(observed, position=str(j)) for j in range(2)] == pytest.approx([0.75, 0.5])


def test_admission_refusal_counters_follow_engine_stats(pb):
    metrics = TritonMetrics(pb, LABELS)
    metrics.refresh(_stats(num_refused_waiting=3, num_refused_sessions=1))
    metrics.refresh(_stats(num_refused_waiting=5, num_refused_sessions=1))
    assert pb.kind("deepinfer_requests_refused_waiting_total") == "counter"
    assert pb.value("deepinfer_requests_refused_waiting_total") == 5
    assert pb.value("deepinfer_sessions_refused_total") == 1


def test_kv_cache_dtype_is_named_by_an_info_gauge(pb):
    TritonMetrics(pb, LABELS, kv_cache_dtype="fp8_e4m3")
    assert pb.kind("deepinfer_kv_cache_dtype_info") == "gauge"
    assert pb.value("deepinfer_kv_cache_dtype_info", kv_cache_dtype="fp8_e4m3") == 1
    other = _PbUtils()
    TritonMetrics(other, LABELS)  # no dtype given (older callers): no such family
    assert not [f for f in other.MetricFamily.created if f.name == "deepinfer_kv_cache_dtype_info"]


def test_queue_time_is_observed_by_priority_with_the_label_clamped(pb):
    metrics = TritonMetrics(pb, LABELS)
    for priority, queued in ((0, 0.5), (0, 1.5), (-3, 0.25), (1000, 2.0)):
        timing = RequestMetrics(arrival_time=10.0, priority=priority, first_scheduled_time=10.0 + queued)
        metrics.on_finished(RequestOutput("r", [], "", finished=True, finish_reason="stop", num_prompt_tokens=1,
                                          num_output_tokens=1, metrics=timing))
    observed = {m.labels["priority"]: m.observed for f in pb.MetricFamily.created
                if f.name == "deepinfer_request_queue_time_seconds" for m in f.metrics}
    assert observed == {"0": [0.5, 1.5], "-3": [0.25], "10": [2.0]}


def test_eplb_imbalance_gauges_per_layer_and_worst(pb):
    from backend_lib.core.outputs import EplbStats

    metrics = TritonMetrics(pb, LABELS)
    metrics.refresh(_stats())  # EPLB off: the families exist, no per-layer series
    assert not [f for f in pb.MetricFamily.created if f.name == "deepinfer_expert_load_imbalance" and f.metrics]
    metrics.refresh(_stats(eplb=EplbStats([1.5, 2.25], rebalances=2, last_pause_s=0.01, moved_slots=6)))
    assert pb.value("deepinfer_expert_load_imbalance", layer="1") == 2.25
    assert pb.value("deepinfer_expert_load_imbalance_worst") == 2.25
    assert pb.value("deepinfer_eplb_rebalances_total") == 2
    assert pb.value("deepinfer_eplb_last_pause_seconds") == 0.01
