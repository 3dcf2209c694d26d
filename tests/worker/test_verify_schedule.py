"""The confidence schedule's length choice on synthetic survival and cost tables (no model)."""
from __future__ import annotations

import pytest

from backend_lib.worker.spec_decode.verify_schedule import HOST_SMOLLM2_COST, VerifyCost, VerifyLengthSchedule

FLAT = VerifyCost(rows=(1, 64), cost=(1.0, 1.0), draft_share=0.0)  # verification is free: draft everything
LINEAR = VerifyCost(rows=(1, 2), cost=(1.0, 2.0), draft_share=0.0)  # every row costs a step: never draft


def _schedule(cost: VerifyCost, k: int = 4) -> VerifyLengthSchedule:
    return VerifyLengthSchedule(k, block_size=4, cost=cost, hysteresis=0.0)


def test_cost_table_interpolates_and_extrapolates():
    assert HOST_SMOLLM2_COST.step(1) == 1.0
    assert HOST_SMOLLM2_COST.step(10) == pytest.approx((1.07 + 1.32) / 2)
    assert HOST_SMOLLM2_COST.step(40) == pytest.approx(2.77 + (2.77 - 2.21) / 8 * 8)
    with pytest.raises(ValueError, match="strictly increasing"):
        VerifyCost(rows=(4, 1), cost=(1.0, 1.0), draft_share=0.1)


def test_free_verification_drafts_the_whole_block_and_linear_cost_none():
    assert _schedule(FLAT).choose(1, 1, [0.9, 0.5, 0.2, 0.1]) == 4
    linear = _schedule(LINEAR)
    assert not linear.worth_drafting(1, 1)
    assert not linear.wants_drafts(1, 1) and linear.previous == 0  # the drafter does not even run


def test_length_maximizes_expected_tokens_per_time():
    """Hand-worked: rows cost 1 up to 2 rows then 0.5 a row, so L drafts cost 1 + 0.5 (L - 1): with survivals
    [0.9, 0.8, 0.1, 0.05], L=1: 1.9/1, L=2: 2.7/1.5 = 1.8, L=3: 2.8/2: the choice is 1."""
    cost = VerifyCost(rows=(1, 2, 3), cost=(1.0, 1.0, 1.5), draft_share=0.0)
    schedule = _schedule(cost)
    survival = [0.9, 0.8, 0.1, 0.05]
    rates = [schedule.rate(1, 1, L, survival) for L in range(5)]
    assert rates[:3] == pytest.approx([1.0, 1.9, 1.8])
    assert schedule.choose(1, 1, survival) == 1
    # a cheaper third row makes the second draft pay: L=2: 2.7 / 1.2 = 2.25, L=3: 2.8 / 1.4 = 2.0, L=1: 1.9
    cheaper = VerifyCost(rows=(1, 2, 3), cost=(1.0, 1.0, 1.2), draft_share=0.0)
    assert _schedule(cheaper).choose(1, 1, survival) == 2


def test_large_batches_turn_drafting_off_on_the_host_table():
    schedule = _schedule(HOST_SMOLLM2_COST)
    assert schedule.choose(1, 1, [0.9, 0.8, 0.7, 0.6]) >= 3  # one stream: the few-row GEMM's flat cost
    assert not schedule.wants_drafts(32, 32)  # 32 streams: past the flat part, rejected drafts only cost


def test_calibration_and_dflash_use_observed_acceptance():
    schedule = _schedule(FLAT)
    for _ in range(60):  # the head says 0.9 everywhere, only the first draft is ever accepted
        schedule.calibration.observe([0.9, 0.81, 0.73, 0.66], accepted=1)
    survival = schedule.survival([0.9, 0.81, 0.73, 0.66])
    assert survival[0] == pytest.approx(1.0, abs=0.01) and survival[1] < 0.01
    assert schedule.survival(None)[0] == pytest.approx(1.0, abs=0.01)  # DFlash: the observed prefix rate
    assert schedule.survival(None)[1] < 0.01


def test_hysteresis_keeps_the_length_and_idle_steps_probe():
    cost = VerifyCost(rows=(1, 2, 3), cost=(1.0, 1.0, 1.25), draft_share=0.0)  # L=2 costs 1.25
    schedule = VerifyLengthSchedule(4, block_size=4, cost=cost, hysteresis=0.05)
    assert schedule.choose(1, 1, [0.9, 0.3, 0.1, 0.05]) == 1
    assert schedule.choose(1, 1, [0.9, 0.55, 0.1, 0.05]) == 1  # L=2: 2.45 / 1.25 = 1.96, 3% over 1.9: kept
    assert schedule.choose(1, 1, [0.9, 0.8, 0.1, 0.05]) == 2  # 2.7 / 1.25 = 2.16: 14% better
    poor = VerifyLengthSchedule(2, block_size=2, cost=HOST_SMOLLM2_COST, hysteresis=0.0, probe_every=4)
    assert poor.wants_drafts(1, 1) and poor.choose(1, 1, [0.0, 0.0]) == 0  # drafting turns off
    runs = [poor.wants_drafts(1, 1) for _ in range(8)]
    assert runs == [False, False, False, True] * 2  # the drafter runs on every 4th idle step only
    assert poor.choose(1, 1, [0.0, 0.0]) == 1  # and that probe verifies one draft
    assert poor.choose(1, 1, [0.9, 0.8]) == 2 and poor.wants_drafts(1, 1)  # a good probe turns drafting back on
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        VerifyLengthSchedule(5, block_size=4)
