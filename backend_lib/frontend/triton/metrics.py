"""Engine metrics as Triton custom metrics (``pb_utils.MetricFamily``), served on Triton's /metrics.

The Python backend deletes a metric when its family object is garbage-collected ("MetricFamily has
been deleted"), so this object holds every family for as long as it holds their metrics.
Only the model's response thread calls into it, so the cumulative-counter bookkeeping needs no lock.
"""
from __future__ import annotations

from typing import Any

from backend_lib.core.outputs import EngineStats, EplbStats, RequestOutput, SpecSurvivalStats

FINISH_REASONS = ("stop", "length", "abort", "error")
# The priority label's values: a request's priority, clamped into this range so the label set stays bounded.
PRIORITY_LABEL_RANGE = (-10, 10)
_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
_TOKEN_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096, 16384]


class _CumulativeCounter:
    """A Triton counter fed from an engine total: advances by the increase since the last total it saw.

    Counters never go down; a total below the last one seen (an engine restart) adds nothing until it
    passes that value again.
    """

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self._last = 0

    def advance_to(self, total: int) -> None:
        if total > self._last:
            self.metric.increment(total - self._last)
            self._last = total


class TritonMetrics:
    """``pb_utils`` is passed in because it only exists inside the Python backend's stub."""

    def __init__(self, pb_utils: Any, labels: dict[str, str], kv_cache_dtype: str = "") -> None:
        family = pb_utils.MetricFamily
        self._families: list[Any] = []  # keeps every family alive (see module docstring)
        self._labels = labels

        def make(kind: Any, name: str, description: str, **metric_kwargs: Any) -> Any:
            fam = family(name=name, description=description, kind=kind)
            self._families.append(fam)
            return fam.Metric(labels=labels, **metric_kwargs)

        counter, gauge, histogram = family.COUNTER, family.GAUGE, family.HISTOGRAM

        def cumulative(name: str, description: str) -> _CumulativeCounter:
            return _CumulativeCounter(make(counter, name, description))

        self.prompt_tokens = cumulative("deepinfer_prompt_tokens_total", "Prompt tokens received")
        self.generation_tokens = cumulative("deepinfer_generation_tokens_total", "Tokens generated")
        self.computed_prompt_tokens = cumulative(
            "deepinfer_prompt_tokens_computed_total",
            "Prompt tokens run through the model (the rest came from the prefix cache or a session's KV)")
        self.preemptions = cumulative("deepinfer_preemptions_total", "Requests preempted to free KV blocks")
        # Admission control: refused at once with UNAVAILABLE instead of queued.
        self.refused_waiting = cumulative("deepinfer_requests_refused_waiting_total",
                                          "Requests refused because max_waiting_requests were already waiting")
        self.refused_sessions = cumulative("deepinfer_sessions_refused_total",
                                           "Session STARTs refused because max_sessions sessions were open")
        requests = family(name="deepinfer_requests_total", description="Finished requests by finish reason",
                          kind=counter)
        self._families.append(requests)
        self.requests = {reason: requests.Metric(labels={**labels, "finish_reason": reason})
                         for reason in FINISH_REASONS}
        self.ttft = make(histogram, "deepinfer_time_to_first_token_seconds", "Arrival to first token",
                         buckets=_LATENCY_BUCKETS)
        self.tpot = make(histogram, "deepinfer_time_per_output_token_seconds",
                         "Mean time between output tokens after the first", buckets=_LATENCY_BUCKETS)
        self.e2e = make(histogram, "deepinfer_e2e_request_latency_seconds", "Arrival to finish",
                        buckets=_LATENCY_BUCKETS)
        self._queue_time_family = family(
            name="deepinfer_request_queue_time_seconds", kind=histogram,
            description=f"Arrival to first scheduled, by request priority (clamped into {PRIORITY_LABEL_RANGE})")
        self._families.append(self._queue_time_family)
        self.queue_time_by_priority: dict[int, Any] = {}  # created when a priority first finishes
        self.prompt_len = make(histogram, "deepinfer_request_prompt_tokens", "Prompt length per request",
                               buckets=_TOKEN_BUCKETS)
        self.output_len = make(histogram, "deepinfer_request_generation_tokens", "Output length per request",
                               buckets=_TOKEN_BUCKETS)
        self.running = make(gauge, "deepinfer_num_requests_running", "Requests in the running batch")
        self.waiting = make(gauge, "deepinfer_num_requests_waiting", "Requests waiting to be scheduled")
        self.blocks_used = make(gauge, "deepinfer_kv_blocks_used", "KV cache blocks in use")
        self.blocks_free = make(gauge, "deepinfer_kv_blocks_free", "KV cache blocks free")
        self.prefix_hit_rate = make(gauge, "deepinfer_prefix_cache_hit_rate",
                                    "Prompt tokens found in the prefix cache / looked up (cumulative)")
        self.sessions = make(gauge, "deepinfer_num_sessions", "Open sessions (Triton sequences)")
        # The KV cache's element type as a label (an info metric, always 1): "float32", "bfloat16", "fp8_e4m3".
        self.kv_cache_dtype = None
        if kv_cache_dtype:
            info = family(name="deepinfer_kv_cache_dtype_info", description="The KV cache's element type (label)",
                          kind=gauge)
            self._families.append(info)
            self.kv_cache_dtype = info.Metric(labels={**labels, "kv_cache_dtype": kv_cache_dtype})
            self.kv_cache_dtype.set(1)
        # Speculative decoding (zero while spec_method is none), named after vLLM's spec_decode metrics.
        self.spec_draft_tokens = cumulative("deepinfer_spec_decode_draft_tokens_total",
                                            "Draft tokens verified by the target model")
        self.spec_accepted_tokens = cumulative("deepinfer_spec_decode_accepted_tokens_total", "Draft tokens accepted")
        self.spec_num_drafts = cumulative("deepinfer_spec_decode_num_drafts_total",
                                          "Verification steps with at least one draft token (request-steps)")
        self.spec_acceptance_rate = make(gauge, "deepinfer_spec_decode_acceptance_rate",
                                         "Accepted / verified draft tokens (cumulative)")
        self.spec_mean_accepted_length = make(
            gauge, "deepinfer_spec_decode_mean_accepted_length",
            "Tokens emitted per verification step: 1 + accepted drafts / drafts (cumulative)")
        self._position_family = family(name="deepinfer_spec_decode_acceptance_rate_per_position",
                                       description="Accepted / verified drafts at draft position (0-based) "
                                                   "(cumulative)", kind=gauge)
        self._families.append(self._position_family)
        # One gauge per draft position, created when the engine first reports that position.
        self.spec_acceptance_per_position: list[Any] = []
        self._length_family = family(name="deepinfer_spec_decode_chosen_length_total",
                                     description="Request-steps whose proposer chose this many drafts for the next "
                                                 "step (0: drafting off), by length", kind=counter)
        self._families.append(self._length_family)
        self.spec_chosen_lengths: list[_CumulativeCounter] = []  # one per length, created when first reported
        # DSpark's survival calibration: the confidence head's prediction next to what verification accepted.
        self._predicted_family = family(name="deepinfer_spec_decode_predicted_survival_per_position", kind=gauge,
                                        description="DSpark: mean survival the confidence head predicted at draft "
                                                    "position (0-based), over the drafts verified there")
        self._observed_family = family(name="deepinfer_spec_decode_observed_survival_per_position", kind=gauge,
                                       description="DSpark: share of those drafts accepted with every draft before "
                                                   "them (the calibration's truth)")
        self._families += [self._predicted_family, self._observed_family]
        self.spec_predicted_survival: list[Any] = []
        self.spec_observed_survival: list[Any] = []
        # EPLB (enable_eplb): the window's busiest expert-parallel rank's tokens / the mean, per MoE layer (label
        # "layer": its index among the EPLB layers, created when first reported) and of the worst layer.
        self._imbalance_family = family(name="deepinfer_expert_load_imbalance",
                                        description="EPLB: busiest rank's routed tokens / mean over the window, "
                                                    "per MoE layer", kind=gauge)
        self._families.append(self._imbalance_family)
        self.expert_imbalance_per_layer: list[Any] = []
        self.expert_imbalance_worst = make(gauge, "deepinfer_expert_load_imbalance_worst",
                                           "EPLB: the worst MoE layer's busiest rank's tokens / mean over the window")
        self.eplb_rebalances = cumulative("deepinfer_eplb_rebalances_total", "EPLB re-placements of the experts")
        self.eplb_pause = make(gauge, "deepinfer_eplb_last_pause_seconds",
                               "EPLB: the last re-placement's pause between two steps")

    def on_finished(self, output: RequestOutput) -> None:
        """Per-request counters and histograms, once, from the request's final output."""
        reason = output.finish_reason if output.finish_reason in self.requests else "error"
        self.requests[reason].increment(1)
        self.prompt_len.observe(output.num_prompt_tokens)
        self.output_len.observe(output.num_output_tokens)
        m = output.metrics
        if m is None:
            return
        if m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
        if m.first_scheduled_time is not None:
            self._queue_time(m.priority).observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            if m.finished_time is not None and output.num_output_tokens > 1:
                self.tpot.observe(max(0.0, m.finished_time - m.first_token_time) / (output.num_output_tokens - 1))

    def _queue_time(self, priority: int) -> Any:
        low, high = PRIORITY_LABEL_RANGE
        label = min(max(priority, low), high)
        if label not in self.queue_time_by_priority:
            self.queue_time_by_priority[label] = self._queue_time_family.Metric(
                labels={**self._labels, "priority": str(label)}, buckets=_LATENCY_BUCKETS)
        return self.queue_time_by_priority[label]

    def refresh(self, stats: EngineStats) -> None:
        """Gauges from a stats snapshot; counters advance by the change of the engine's cumulative totals."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.blocks_used.set(stats.kv_blocks_used)
        self.blocks_free.set(stats.kv_blocks_free)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        self.sessions.set(stats.num_sessions)
        self.prompt_tokens.advance_to(stats.num_prompt_tokens)
        self.generation_tokens.advance_to(stats.num_generation_tokens)
        self.computed_prompt_tokens.advance_to(stats.num_computed_prompt_tokens)
        self.preemptions.advance_to(stats.num_preemptions)
        self.refused_waiting.advance_to(stats.num_refused_waiting)
        self.refused_sessions.advance_to(stats.num_refused_sessions)
        self.spec_draft_tokens.advance_to(stats.spec_draft_tokens)
        self.spec_accepted_tokens.advance_to(stats.spec_accepted_tokens)
        self.spec_num_drafts.advance_to(stats.spec_num_drafts)
        self.spec_acceptance_rate.set(stats.spec_acceptance_rate)
        self.spec_mean_accepted_length.set(stats.spec_mean_accepted_length)
        rates = stats.spec_acceptance_rate_per_position
        while len(self.spec_acceptance_per_position) < len(rates):
            position = len(self.spec_acceptance_per_position)
            self.spec_acceptance_per_position.append(
                self._position_family.Metric(labels={**self._labels, "position": str(position)}))
        for gauge, rate in zip(self.spec_acceptance_per_position, rates):
            gauge.set(rate)
        while len(self.spec_chosen_lengths) < len(stats.spec_chosen_lengths):
            length = len(self.spec_chosen_lengths)
            self.spec_chosen_lengths.append(_CumulativeCounter(
                self._length_family.Metric(labels={**self._labels, "length": str(length)})))
        for counter, total in zip(self.spec_chosen_lengths, stats.spec_chosen_lengths):
            counter.advance_to(total)
        if stats.spec_survival is not None:
            self._refresh_spec_survival(stats.spec_survival)
        if stats.eplb is not None:
            self._refresh_eplb(stats.eplb)

    def _refresh_spec_survival(self, survival: SpecSurvivalStats) -> None:
        for family, metrics, values in ((self._predicted_family, self.spec_predicted_survival, survival.predicted),
                                        (self._observed_family, self.spec_observed_survival, survival.observed)):
            while len(metrics) < len(values):
                metrics.append(family.Metric(labels={**self._labels, "position": str(len(metrics))}))
            for gauge, value in zip(metrics, values):
                gauge.set(value)

    def _refresh_eplb(self, eplb: EplbStats) -> None:
        while len(self.expert_imbalance_per_layer) < len(eplb.layer_imbalance):
            layer = len(self.expert_imbalance_per_layer)
            self.expert_imbalance_per_layer.append(
                self._imbalance_family.Metric(labels={**self._labels, "layer": str(layer)}))
        for gauge, value in zip(self.expert_imbalance_per_layer, eplb.layer_imbalance):
            gauge.set(value)
        self.expert_imbalance_worst.set(eplb.worst_imbalance)
        self.eplb_rebalances.advance_to(eplb.rebalances)
        self.eplb_pause.set(eplb.last_pause_s)
