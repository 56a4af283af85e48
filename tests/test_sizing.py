"""Sizing from recorded gateway metrics (gateway plan --from-metrics)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gateway.__main__ import main
from gateway.planner.sizing import histogram_quantile, recommend

RECORDED = Path(__file__).parent / "data" / "gateway_metrics.txt"


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = [(1024.0, 90.0), (2048.0, 90.0), (3072.0, 100.0), (math.inf, 100.0)]
    assert histogram_quantile(0.95, buckets) == pytest.approx(2560.0)
    assert histogram_quantile(0.5, buckets) == pytest.approx(1024 * 50 / 90)
    assert histogram_quantile(0.5, [(math.inf, 0.0)]) is None
    assert histogram_quantile(0.99, [(100.0, 1.0), (math.inf, 10.0)]) == 100.0


def test_recommendation_from_recorded_metrics() -> None:
    # Recorded: 90 requests of 600 + 300 tokens, 10 of 1200 + 1500; capacity 16384, 4 x 4096.
    r = recommend(RECORDED.read_text(), margin=0.1)["local"]
    assert r["requests"] == 100
    q = r["quantiles"]["request_tokens"]
    assert q["p95"] == pytest.approx(2560.0)  # 2048 + 1024 x (95 - 90) / (100 - 90)
    assert r["recommended_ctx_per_slot"] == 2816  # ceil(2560 x 1.1) = 2816, a multiple of 256
    assert r["recommended_slots"] == 5  # 16384 // 2816
    assert r["current_slots"] == 4 and r["current_ctx_per_slot"] == 4096


def test_the_slots_gauge_is_read_under_its_new_and_its_old_name() -> None:
    # The recording holds the old name, gateway_slots_total; a newer gateway exports
    # gateway_slots (a gauge must not carry a counter's suffix).
    old = RECORDED.read_text()
    assert "gateway_slots_total{" in old
    new = old.replace("gateway_slots_total", "gateway_slots").replace(
        'gateway_slots{backend="local"} 4.0', 'gateway_slots{backend="local"} 6.0')
    assert recommend(old)["local"]["current_slots"] == 4
    assert recommend(new)["local"]["current_slots"] == 6


def test_margin_changes_the_recommendation() -> None:
    r = recommend(RECORDED.read_text(), margin=0.5)["local"]
    assert r["recommended_ctx_per_slot"] == 3840  # ceil(2560 x 1.5) = 3840


def test_no_observations_is_an_error() -> None:
    with pytest.raises(ValueError):
        recommend("# nothing here\n")


def test_cli_reads_a_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--from-metrics", str(RECORDED)]) == 0
    out = capsys.readouterr().out
    assert "recommended ctx_per_slot 2816" in out and "-np 5" in out
