"""The generation probe's figures (integrations/ray/probe.py): each staging reading against the
idle readings on both sides of it, the median of the rounds, and readings that do not alternate
refused. The probe on a real cluster: tests/integration/test_rl_demo.py."""

from __future__ import annotations

import pytest

from weighthub.integrations.ray.probe import probe_figures


def test_each_round_is_judged_against_its_neighbouring_idle_readings() -> None:
    # the machine slows over the probe: idle 100 -> 80; staging reads 95, 85, 70
    got = probe_figures([100.0, 90.0, 80.0, 80.0], [95.0, 85.0, 70.0],
                        gen_s=[3.0, 3.2, 3.4], stage_s=[0.06, 0.08, 0.34])
    assert got["rounds"] == 3
    assert got["ratios"] == [95 / 95, 85 / 85, 70 / 80]
    assert got["ratio"] == 1.0  # the median: one slow round does not decide the verdict
    assert (got["ratio_min"], got["ratio_max"]) == (70 / 80, 1.0)
    assert got["idle_spread"] == pytest.approx(0.25)  # 100 against 80
    assert got["stage_share"] == pytest.approx(0.08 / 3.2)


def test_one_round_is_the_old_single_reading() -> None:
    got = probe_figures([47.0, 49.0], [45.0], gen_s=[3.17], stage_s=[0.07])
    assert got["ratio"] == got["ratio_min"] == got["ratio_max"] == 45 / 48


@pytest.mark.parametrize(("idle", "staging", "gen_s", "stage_s", "match"), [
    ([], [], [], [], "do not alternate"),
    ([50.0, 50.0], [], [], [], "do not alternate"),
    ([50.0], [45.0], [3.0], [0.1], "do not alternate"),  # no idle reading after the staging
    ([50.0, 50.0, 50.0], [45.0], [3.0], [0.1], "do not alternate"),
    ([50.0, 50.0], [45.0], [], [0.1], "do not alternate"),
    ([50.0, 0.0], [45.0], [3.0], [0.1], "not positive"),
    ([50.0, 50.0], [-1.0], [3.0], [0.1], "not positive"),
])
def test_readings_that_do_not_alternate_are_refused(idle: list[float], staging: list[float],
                                                     gen_s: list[float], stage_s: list[float],
                                                     match: str) -> None:
    with pytest.raises(ValueError, match=match):
        probe_figures(idle, staging, gen_s=gen_s, stage_s=stage_s)


def test_rounds_below_one_are_refused_before_any_work() -> None:
    from weighthub.integrations.ray.probe import generation_probe

    with pytest.raises(ValueError, match="rounds must be ≥ 1"):
        generation_probe(object(), 0, 0)  # the loop is never touched
