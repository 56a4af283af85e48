"""Latency targets per class (ttft_p95_s, itl_p95_s) and a request's TTFT deadline header."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.admission.tenants import Tenants
from gateway.config import ConfigError, load_settings
from gateway.errors import InvalidRequest
from gateway.wire.slo import MAX_TTFT_MS, parse_ttft_deadline
from tests.conftest import Harness

CLASSES = [{"name": "chat", "ttft_p95_s": 2.0, "itl_p95_s": 0.08},
           {"name": "batch"}]


def test_targets_are_optional_positive_seconds() -> None:
    s = load_settings(classes=CLASSES)
    assert (s.classes[0].ttft_p95_s, s.classes[0].itl_p95_s) == (2.0, 0.08)
    assert (s.classes[1].ttft_p95_s, s.classes[1].itl_p95_s) == (None, None)
    for bad in (0, -1, float("inf"), float("nan"), "soon"):
        for key in ("ttft_p95_s", "itl_p95_s"):
            with pytest.raises(ConfigError, match=key):
                load_settings(classes=[{"name": "chat", key: bad}])


def test_a_party_carries_its_class_targets() -> None:
    tenants = Tenants(load_settings(classes=CLASSES))
    anyone = tenants.by_name["anonymous"]
    chat = tenants.party(anyone)
    assert (chat.ttft_target_s, chat.itl_target_s, chat.ttft_deadline_s) == (2.0, 0.08, None)
    batch = tenants.party(anyone, "batch")
    assert (batch.ttft_target_s, batch.itl_target_s) == (None, None)
    plain = Tenants(load_settings()).party(Tenants(load_settings()).by_name["anonymous"])
    assert plain.ttft_target_s is None and plain.itl_target_s is None


def h(*pairs: tuple[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode()) for k, v in pairs]


def test_the_deadline_headers() -> None:
    assert parse_ttft_deadline(h(("x-gateway-slo-ttft-ms", "800"))) == 0.8
    assert parse_ttft_deadline(h(("x-llm-d-slo-ttft-ms", "1500.5"))) == 1.5005
    assert parse_ttft_deadline(h(("x-slo-ttft-ms", " 250 "))) == 0.25
    assert parse_ttft_deadline(h(("x-gateway-slo-ttft-ms", "900"),
                                 ("x-llm-d-slo-ttft-ms", "300"))) == 0.3  # the tightest
    assert parse_ttft_deadline(h(("x-gateway-slo-ttft-ms", ""))) is None
    assert parse_ttft_deadline(h(("x-priority", "batch"))) is None
    assert parse_ttft_deadline([]) is None


@pytest.mark.parametrize("value", ["0", "-5", "abc", "1e3", "inf", "nan", "0x10", "1_000",
                                   "5 ms", str(MAX_TTFT_MS + 1), "0.0"])
def test_bad_deadlines_are_a_400_naming_the_header(value: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_ttft_deadline(h(("x-llm-d-slo-ttft-ms", "100"), ("x-gateway-slo-ttft-ms", value)))
    assert caught.value.status_code == 400 and caught.value.param == "x-gateway-slo-ttft-ms"


@given(ms=st.integers(1, MAX_TTFT_MS), other=st.integers(1, MAX_TTFT_MS))
def test_any_whole_milliseconds_parse_to_the_tightest_seconds(ms: int, other: int) -> None:
    got = parse_ttft_deadline(h(("x-gateway-slo-ttft-ms", str(ms)), ("x-slo-ttft-ms",
                                                                       str(other))))
    assert got == min(ms, other) / 1000


async def test_a_bad_deadline_header_is_refused_before_the_backend(
        harness_factory: Any) -> None:
    harness: Harness = await harness_factory()
    before = len(harness.fake.requests)
    r = await harness.client.post("/v1/chat/completions", headers={
        "x-gateway-slo-ttft-ms": "soon"}, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "x-gateway-slo-ttft-ms" and "milliseconds" in error["message"]
    assert len(harness.fake.requests) == before  # nothing counted or forwarded
    ok = await harness.client.post("/v1/chat/completions", headers={
        "x-gateway-slo-ttft-ms": "5000"}, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
    assert ok.status_code == 200
