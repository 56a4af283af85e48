"""Sizing from users (gateway plan --users): Little's law, slots, KV fit, backend settings."""

from __future__ import annotations

import json
import math
import tomllib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.__main__ import main
from gateway.config import load_settings
from gateway.planner import modelshape
from gateway.planner.planning import kv_size, parse_bytes
from gateway.planner.users import (
    UserLoad,
    binomial_quantile,
    in_flight,
    queue_bounds,
    render_users,
    size_from_users,
    slots_for,
)

SHAPE = modelshape.from_dims(32, 8, 128)  # 128 KiB of KV per token


def test_the_issues_example_is_2_7_in_flight(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--users", "20", "--turn-s", "12", "--think-s", "90", "--layers",
                 "32", "--kv-heads", "8", "--head-dim", "128", "--kv-memory", "2GiB"]) == 0
    text = capsys.readouterr().out
    assert "2.7 on average" in text and "fits" in text and "-np 4" in text
    assert main(["plan", "--users", "20", "--turn-s", "12", "--think-s", "90", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert round(r["in_flight"], 2) == 2.67 and r["slots"] == 4


def test_think_s_is_request_to_request() -> None:
    # The turn is inside think_s: 10 users busy 30 s of every 60 s are 5 in flight.
    assert in_flight(10, 30, 60) == 5
    with pytest.raises(ValueError, match="turn included"):
        UserLoad(10, 30, 20)
    with pytest.raises(ValueError):
        UserLoad(0, 1, 2)


@given(users=st.integers(1, 500), turn=st.floats(0.1, 60), extra=st.floats(0, 600),
       headroom=st.floats(0, 1))
def test_slots_cover_the_mean_with_headroom(users: int, turn: float, extra: float,
                                            headroom: float) -> None:
    mean = in_flight(users, turn, turn + extra)
    slots = slots_for(mean, headroom)
    assert slots >= 1 and slots >= mean * (1 + headroom) - 1e-6
    assert slots - 1 < max(1.0, mean * (1 + headroom))
    assert mean <= users + 1e-9


@given(n=st.integers(1, 60), p=st.floats(0.01, 0.99), q=st.floats(0.5, 0.999))
def test_binomial_quantile_is_the_smallest_k(n: int, p: float, q: float) -> None:
    k = binomial_quantile(n, p, q)

    def cdf(k: int) -> float:
        return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))

    assert 0 <= k <= n
    assert cdf(k) >= q - 1e-9
    assert k == 0 or cdf(k - 1) < q


def test_queue_bounds() -> None:
    load = UserLoad(20, 12, 90)
    b = queue_bounds(load, 4)
    assert b["max_queue"] == 16  # users - slots: one turn at a time each
    assert b["busy_p99"] == binomial_quantile(20, 12 / 90, 0.99)
    assert b["max_queue_wait_s"] == 12 * max(1, math.ceil((b["busy_p99"] - 4) / 4))
    # Undersized: 40 users busy half the time on 2 slots wait several rounds of turns.
    heavy = queue_bounds(UserLoad(40, 10, 20), 2)
    assert heavy["max_queue_wait_s"] == 10 * math.ceil((heavy["busy_p99"] - 2) / 2)
    assert heavy["max_queue_wait_s"] >= 50


def test_kv_fit_uses_the_planner_arithmetic() -> None:
    load = UserLoad(50, 10, 60, prompt_tokens=3000, answer_tokens=800)
    r = size_from_users(load, shape=SHAPE, kv_budget=parse_bytes("2GiB"))
    assert r["ctx_per_slot"] == 3840 and r["slots"] == math.ceil(50 * 10 / 60 * 1.25)
    assert r["kv"]["bytes"] == kv_size(SHAPE, r["slots"] * 3840, r["slots"],
                                       unified=False).total_bytes
    assert r["kv"]["fits"] is False  # 11 slots x 3840 x 128 KiB = 5.2 GiB
    assert r["kv"]["most_slots_at_ctx"] == 4
    assert "DOES NOT FIT" in render_users(r)
    ok = size_from_users(load, shape=SHAPE, kv_budget=parse_bytes("6GiB"))
    assert ok["kv"]["fits"] is True
    assert size_from_users(load)["kv"]["fits"] is None


def test_settings_for_each_backend_kind() -> None:
    load = UserLoad(20, 12, 90, prompt_tokens=1500, answer_tokens=400)
    r = size_from_users(load, type_k="q8_0", type_v="q8_0")
    s = r["settings"]
    assert r["ctx_per_slot"] == 2048 and r["slots"] == 4
    assert s["llama_server"].endswith("-c 8192 -np 4 --no-kv-unified -ctk q8_0 -ctv q8_0 -fa on")
    assert s["ollama_env"] == {"OLLAMA_NUM_PARALLEL": "4", "OLLAMA_CONTEXT_LENGTH": "2048",
                               "OLLAMA_MAX_QUEUE": "8"}
    assert "--max-num-seqs 4 --max-model-len 2048" in s["vllm"]
    settings = load_settings(**tomllib.loads(s["gateway"]))  # the gateway accepts the block
    assert settings.admission.max_queue == 16
    assert settings.admission.max_queue_wait_s == s["gateway_admission"]["max_queue_wait_s"]
    assert settings.backends[0].slots == 4 and settings.backends[0].ctx_per_slot == 2048
    assert r["decode"]["itl_needed_s"] == pytest.approx(12 / 400)
    unified = size_from_users(load, unified=True)["settings"]
    assert "--kv-unified" in unified["llama_server"] and "pool_tokens = 8192" in unified["gateway"]
    load_settings(**tomllib.loads(unified["gateway"]))


def test_context_sources() -> None:
    load = UserLoad(20, 12, 90)
    assert size_from_users(load, ctx=3000)["ctx_per_slot"] == 3072
    widest = size_from_users(load, shape=SHAPE, kv_budget=parse_bytes("1GiB"))
    assert widest["ctx_per_slot"] == 2048 and widest["kv"]["fits"] is True
    assert size_from_users(load)["ctx_per_slot"] == 4096


def test_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--users", "20", "--turn-s", "12"]) == 2
    assert "--think-s" in capsys.readouterr().err
    assert main(["plan", "--users", "20", "--turn-s", "12", "--think-s", "5"]) == 2


def test_users_with_a_learned_curve_say_what_latency_they_will_see(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """--from-metrics with --users reads the curve a gateway learnt: the ITL p95 at the
    plan's busy slots (the nearest learned level above, else below as a lower bound)
    and the TTFT of a turn that does not wait."""
    from gateway.planner.curve import Curve, expected, parse_curves

    text = "\n".join([
        "# TYPE gateway_latency_itl_p95_seconds gauge",
        'gateway_latency_itl_p95_seconds{backend="gpu",level="1"} 0.02',
        'gateway_latency_itl_p95_seconds{backend="gpu",level="4"} 0.05',
        "# TYPE gateway_latency_prefill_tokens_per_second gauge",
        'gateway_latency_prefill_tokens_per_second{backend="gpu"} 1000',
        "# TYPE gateway_slots gauge", 'gateway_slots{backend="gpu"} 4', ""])
    curves = parse_curves(text)
    assert curves == {"gpu": Curve({1: 0.02, 4: 0.05}, 1000.0)}
    seen = expected(curves["gpu"], 3, 500)
    assert (seen["from_level"], seen["itl_p95_s"], seen["at_least"]) == (4, 0.05, False)
    assert seen["ttft_s"] == pytest.approx(0.55)
    assert expected(curves["gpu"], 6, None)["at_least"] is True
    assert expected(Curve(), 2, 100) == {"level": 2, "from_level": None, "itl_p95_s": None,
                                        "at_least": False, "ttft_s": None}
    metrics = tmp_path / "metrics.txt"
    metrics.write_text(text)
    assert main(["plan", "--users", "20", "--turn-s", "12", "--think-s", "90",
                 "--prompt-tokens", "500", "--answer-tokens", "300",
                 "--from-metrics", str(metrics), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    level = min(report["slots"], report["busy_p95"])
    assert report["latency"]["gpu"] == expected(curves["gpu"], level, 500)
    assert main(["plan", "--users", "20", "--turn-s", "12", "--think-s", "90",
                 "--prompt-tokens", "500", "--answer-tokens", "300",
                 "--from-metrics", str(metrics)]) == 0
    assert "learned        gpu: ITL p95" in capsys.readouterr().out
    assert main(["plan", "--users", "20", "--turn-s", "12", "--think-s", "90",
                 "--from-metrics", str(tmp_path / "missing.txt")]) == 2


def test_users_from_metrics_take_the_running_backends_context(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a first try: with --from-metrics and no --ctx or tokens, the plan took
    Ollama's default 4096 although the running backend's slots hold 512."""
    metrics = tmp_path / "metrics.txt"
    metrics.write_text("# TYPE gateway_backend_ctx_per_slot gauge\n"
                       'gateway_backend_ctx_per_slot{backend="local"} 512\n')
    assert main(["plan", "--users", "20", "--turn-s", "12", "--think-s", "90",
                 "--from-metrics", str(metrics), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ctx_per_slot"] == 512 and "running backend" in report["ctx_source"]
    assert main(["plan", "--users", "20", "--turn-s", "12", "--think-s", "90",
                 "--ctx", "1024", "--from-metrics", str(metrics), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ctx_per_slot"] == 1024  # --ctx wins
