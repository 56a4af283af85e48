"""The decode pace of a gateway that has seen no stream (issue 38): from llama-server's
``timings`` on a calibration request at the first discovery, and on every whole answer,
so that a doomed request is refused at arrival from the first, whatever its shape."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.wire.events import decode_pace

DOOMED = {"max_tokens": 900, "ignore_eos": True}  # runs to its cap: its length is known


def test_decode_pace_reads_llama_server_timings_and_ollama_durations() -> None:
    assert decode_pace({"timings": {"predicted_n": 16, "predicted_per_token_ms": 12.5}}) \
        == pytest.approx(0.0125)
    assert decode_pace({"eval_count": 100, "eval_duration": 2_000_000_000}) \
        == pytest.approx(0.02)
    for nothing in ({}, [], None, {"timings": {"predicted_n": 1, "predicted_per_token_ms": 9}},
                    {"timings": {"predicted_n": 16, "predicted_per_token_ms": "9"}},
                    {"timings": {"predicted_n": True, "predicted_per_token_ms": 9.0}},
                    {"timings": {"predicted_n": 16, "predicted_per_token_ms": float("inf")}},
                    {"eval_count": 0, "eval_duration": 5}, {"timings": "x"}):
        assert decode_pace(nothing) is None


async def _running(fake: Any) -> None:
    """Until the fake runs a generation (at most 2 s)."""
    for _ in range(200):
        await asyncio.sleep(0.01)
        if fake.active:
            return


async def _doomed_at_arrival(h: Any, fake: Any) -> tuple[int, float]:
    """One whole answer holds the only slot; a second of 900 tokens arrives: (its status,
    its Retry-After), within 2 s (a wait would take the gateway's 6)."""
    fake.hold = asyncio.Event()
    first = asyncio.ensure_future(h.chat(**DOOMED))
    await _running(fake)
    try:
        second = await asyncio.wait_for(h.chat(**DOOMED), 2.0)
    finally:
        fake.hold.set()
    assert (await first).status_code == 200
    return second.status_code, float(second.headers.get("retry-after", 0))


@pytest.fixture
def one_slot(fake: Any) -> Any:
    fake.slots, fake.n_ctx, fake.tokens, fake.pace_s = 1, 4096, 900, 0.03
    return fake


async def test_a_fresh_gateway_calibrates_and_refuses_a_doomed_whole_answer(
        harness_factory: Any, one_slot: Any) -> None:
    """The seed case on a fresh gateway: 30 ms a token, so a 900-token answer holds the
    slot ~27 s; the next one, with a 6 s bound, is refused at once with a Retry-After
    near that, not after waiting 6 s for a 503 that says 1."""
    h = await harness_factory({"max_queue_wait_s": 6.0}, calibrate=True)
    calibration = [g for g in one_slot.generations if "n_predict" in g]
    assert len(calibration) == 2 and calibration[0]["n_predict"] <= 32  # (a cold first)
    status, retry_after = await _doomed_at_arrival(h, one_slot)
    assert status == 503
    assert 13 <= retry_after <= 54  # within 2x of ~27 s


async def test_without_calibration_a_whole_answer_teaches_the_pace(
        harness_factory: Any, one_slot: Any) -> None:
    h = await harness_factory({"max_queue_wait_s": 6.0}, calibrate=False)
    assert not [g for g in one_slot.generations if "n_predict" in g]
    assert (await h.chat(max_tokens=100)).status_code == 200  # 100 tokens at 30 ms
    assert h.backend.admission.slo.seconds_per_token() == pytest.approx(0.03)
    status, retry_after = await _doomed_at_arrival(h, one_slot)
    assert status == 503 and 13 <= retry_after <= 54


async def test_a_gateway_that_knows_no_pace_still_queues(harness_factory: Any,
                                                         one_slot: Any) -> None:
    """Without calibration and before any answer, nothing predicts the wait: the second
    request queues (and is served once the first ends), as before."""
    h = await harness_factory({"max_queue_wait_s": 6.0}, calibrate=False)
    with pytest.raises(TimeoutError):
        await _doomed_at_arrival(h, one_slot)


@pytest.mark.parametrize("calibrate", [False, True])
async def test_a_pace_per_token_never_refuses_an_answer_of_unknown_length(
        harness_factory: Any, fake: Any, calibrate: bool) -> None:
    """From the adversarial pass: a calibrated fresh gateway multiplied the pace per
    token by a cap the answer never reaches (no max_tokens: the slot's room), predicted
    a 31 s wait and refused a request that started 0.3 s later. Until served leases are
    timed, a lease of unknown length (not ignore_eos, no predicted length) makes no
    prediction: it queues, as before."""
    fake.slots, fake.n_ctx, fake.tokens, fake.pace_s = 1, 4096, 5, 0.03
    h = await harness_factory({"max_queue_wait_s": 6.0}, calibrate=calibrate)
    fake.hold = asyncio.Event()
    first = asyncio.ensure_future(h.chat())
    await _running(fake)
    second = asyncio.ensure_future(h.chat(max_tokens=900))
    await asyncio.sleep(0.3)
    fake.hold.set()
    assert (await first).status_code == 200
    assert (await second).status_code == 200


async def test_a_queue_timeout_before_any_release_says_when_it_could_start(
        harness_factory: Any, one_slot: Any) -> None:
    """From the fresh-user pass: before any lease was released, a request that timed out
    in the queue behind a 900-token answer was told Retry-After 1 (the drain rate's
    guess without history). It is now told when it could start, from the pace."""
    h = await harness_factory({"max_queue_wait_s": 1.0, "reject_predicted_timeouts": False},
                              calibrate=True)
    one_slot.hold = asyncio.Event()
    first = asyncio.ensure_future(h.chat(**DOOMED))
    await _running(one_slot)
    second = await h.chat(**DOOMED)
    one_slot.hold.set()
    assert (await first).status_code == 200
    assert second.status_code == 503
    assert second.json()["error"]["code"] == "queue_timeout"
    assert 13 <= float(second.headers["retry-after"]) <= 54  # ~26 s of the first left
