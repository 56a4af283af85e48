"""The predictive policy: predicted charges, live accounting, preemption and resume.

The pure parts (victim choice, length prediction, the admission's live accounting) are
tested directly, with Hypothesis over interleavings. The whole path runs in-process over
``tests.fakes.FakeLlamaServer`` with a unified pool that fails every stream in flight
when it runs out, as llama-server does; the real llama-server is exercised in
``tests/integration/test_predictive_real.py``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.admission import Admission
from gateway.admission.lease import Lease
from gateway.core.capacity import Charge, Layout, LiveUse, choose_victims
from gateway.core.predict import CompletionLengths
from gateway.wire.resume import (
    Continuation,
    Reassembler,
    answer_shape,
    restartable,
    resumable,
)
from tests.fakes import ManualClock, count_words

pytestmark = pytest.mark.anyio

# -- victim choice ---------------------------------------------------------------------

uses_strategy = st.lists(st.builds(
    LiveUse, key=st.integers(0, 10**6), used=st.integers(0, 3000),
    growth=st.integers(0, 60), generated=st.integers(0, 2000), preemptible=st.booleans(),
    since=st.floats(0, 100)), max_size=12, unique_by=lambda u: u.key)


@given(uses_strategy, st.integers(0, 20000))
def test_victims_bring_use_under_the_limit_least_progress_first(
        uses: list[LiveUse], limit: int) -> None:
    victims = choose_victims(uses, limit)
    by_key = {u.key: u for u in uses}
    left = sum(u.used + u.growth for u in uses if u.key not in victims)
    assert all(by_key[k].preemptible for k in victims)
    if victims:  # only when over, and then under unless every preemptible one went
        assert sum(u.used + u.growth for u in uses) > limit
        assert left <= limit or set(victims) == {u.key for u in uses if u.preemptible}
        spared = [u for u in uses if u.preemptible and u.key not in victims]
        assert all(by_key[k].generated <= s.generated for k in victims for s in spared)
        assert left + by_key[victims[-1]].used + by_key[victims[-1]].growth > limit
    else:
        assert left <= limit or not any(u.preemptible for u in uses)


def test_victim_ties_go_to_the_latest_admitted() -> None:
    uses = [LiveUse(1, 100, 1, 5, True, since=1.0), LiveUse(2, 100, 1, 5, True, since=2.0)]
    assert choose_victims(uses, 150) == [2]


# -- length prediction -------------------------------------------------------------------


def test_prediction_waits_for_history_then_charges_the_quantile_within_the_cap() -> None:
    lengths = CompletionLengths(quantile=0.9, min_history=10)
    for n in range(1, 10):
        lengths.record(n * 10)
    assert lengths.predict(500) is None  # 9 seen: the cap is charged
    lengths.record(100)
    assert lengths.value() == 90  # nearest rank: the 9th of 10
    assert lengths.predict(500) == 90 and lengths.predict(40) == 40


def test_prediction_refuses_bad_settings() -> None:
    with pytest.raises(ValueError):
        CompletionLengths(quantile=0.0)
    with pytest.raises(ValueError):
        CompletionLengths(min_history=0)


def test_predicted_charge_counts_against_the_pool_but_the_cap_must_fit_the_slot() -> None:
    charge = Charge(30, 1000, predicted=100)
    assert charge.tokens == 130 and charge.output_charged == 100
    assert Charge(30, 50, predicted=100).tokens == 80  # never more than the cap
    assert Charge(30, 1000, predicted=100, block_size=16).tokens == 144


# -- live accounting in the admission ---------------------------------------------------

POOL = Layout(slots=4, ctx_per_slot=2048, pool_tokens=2048)


def _admission(clock: ManualClock, margin: int = 32) -> Admission:
    return Admission(POOL, max_queue=16, max_wait_s=30.0, clock=clock, predictive=True,
                     preempt_margin_tokens=margin)


def _tracked(lease: Lease, preempted: list[Lease]) -> Lease:
    lease.tracked = lease.preemptible = True
    lease.on_preempt = lambda reason: preempted.append(lease)
    return lease


async def test_predictive_admits_on_predictions_and_preempts_least_progress() -> None:
    clock = ManualClock()
    adm = _admission(clock)
    preempted: list[Lease] = []
    leases = [_tracked(adm.try_admit(Charge(100, 1500, predicted=300)), preempted)
              for _ in range(4)]
    assert all(leases) and adm.stats().busy_slots == 4  # strict would admit one
    for step in range(1, 600):
        clock.advance(0.01)
        for lease in leases:
            if lease not in preempted:
                adm.observe(lease, step if lease is not leases[2] else step // 2)
        live = sum(lease.used_tokens for lease in leases if lease not in preempted)
        assert live <= POOL.capacity_tokens - 32
    assert preempted and preempted[0] is leases[2]  # the slowest one, least progress
    assert adm.preemptions["pool_pressure"] == len(preempted)


async def test_an_untracked_lease_counts_as_its_charge_and_is_never_chosen() -> None:
    clock = ManualClock()
    adm = _admission(clock)
    preempted: list[Lease] = []
    full = adm.try_admit(Charge(100, 1400))  # untracked: charged its whole cap
    assert full is not None
    tracked = _tracked(adm.try_admit(Charge(50, 1000, predicted=50)), preempted)
    assert adm.try_admit(Charge(50, 1000, predicted=500)) is None  # 1500+100+550+32 > 2048
    for step in range(1, 500):
        clock.advance(0.01)
        adm.observe(tracked, step)
        if preempted:
            break
    assert preempted == [tracked] and tracked.generated < 500
    assert tracked.used_tokens + 1500 <= 2048


async def test_a_request_still_in_its_prefill_is_not_chosen() -> None:
    """llama-server cannot cancel a request during its prefill (it notices a closed
    stream at its next write), so the victim is a decoding stream even with more
    progress; once the newcomer's first token arrives, it is the least-progress victim
    again."""
    clock = ManualClock()
    adm = _admission(clock)
    preempted: list[Lease] = []
    decoding = _tracked(adm.try_admit(Charge(700, 1300, predicted=5)), preempted)
    prefilling = _tracked(adm.try_admit(Charge(700, 1300, predicted=5)), preempted)
    for step in range(1, 700):
        clock.advance(0.01)
        adm.observe(decoding, step)
        if preempted:
            break
    assert preempted == [decoding] and prefilling.first_token_at is None
    adm.release(decoding, served=False)
    other = _tracked(adm.try_admit(Charge(700, 1300, predicted=5)), preempted)
    for step in range(1, 700):
        clock.advance(0.01)
        adm.observe(other, 300 + step)
        adm.observe(prefilling, step)
        if len(preempted) > 1:
            break
    assert preempted[1] is prefilling  # now decoding, with the least progress


events = st.lists(st.tuples(st.sampled_from(["admit", "token", "finish", "cancel"]),
                            st.integers(0, 7), st.integers(1, 40)), max_size=120)


@settings(max_examples=60, deadline=None)
@given(events, st.integers(0, 64))
def test_live_use_stays_under_the_pool_whatever_the_interleaving(
        ops: list[tuple[str, int, int]], margin: int) -> None:
    """Any interleaving of admissions, token arrivals, finishes, client cancels and
    preemptions: at every observation the leases not preempted hold at most the pool
    less the margin, and once all are released nothing is left reserved or live."""

    async def run() -> None:
        clock = ManualClock()
        adm = _admission(clock, margin)
        preempted: list[Lease] = []
        live: list[Lease] = []
        for op, pick, size in ops:
            clock.advance(0.05)
            if op == "admit":
                lease = adm.try_admit(Charge(size * 5, size * 30, predicted=size * 2))
                if lease is not None:
                    live.append(_tracked(lease, preempted))
            elif live:
                lease = live[pick % len(live)]
                if op == "token" and lease not in preempted:
                    adm.observe(lease, min(lease.charge.max_tokens, lease.generated + size))
                    kept = [le for le in live if le not in preempted]
                    assert sum(le.used_tokens for le in kept) <= POOL.capacity_tokens - margin
                elif op in ("finish", "cancel") or lease in preempted:
                    adm.release(lease, served=op == "finish")
                    live.remove(lease)
            for lease in [le for le in live if le in preempted]:
                adm.release(lease, served=False)  # its holder gives it back
                live.remove(lease)
        for lease in live:
            adm.release(lease)
        stats = adm.stats()
        assert (stats.reserved_tokens, stats.busy_slots, stats.live_tokens,
                stats.inflight) == (0, 0, 0, 0)

    asyncio.run(run())


# -- continuation ------------------------------------------------------------------------


def test_only_plain_single_answers_are_resumable() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert resumable("chat", chat)
    assert not resumable("chat", {**chat, "tools": [{"type": "function"}]})
    assert not resumable("chat", {**chat, "n": 2})
    assert not resumable("chat", {**chat, "response_format": {"type": "json_object"}})
    assert resumable("chat", {**chat, "response_format": {"type": "text"}})
    assert not resumable("chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}]})
    assert resumable("completions", {"prompt": "once"})
    assert not resumable("completions", {"prompt": [1, 2, 3]})
    assert not resumable("completions", {"prompt": "once", "logprobs": 2})


def test_a_chat_continuation_prefills_and_strips_the_repeat() -> None:
    cont = Continuation("chat", prompt_tokens=20)
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 10,
            "max_completion_tokens": 10}
    for obj in ({"id": "a", "created": 1, "choices": [{"delta": {"role": "assistant"}}]},
                {"id": "a", "choices": [{"delta": {"content": "Hello"}}]},
                {"id": "a", "choices": [{"delta": {"content": " world"}}]}):
        assert cont.rewrite(obj) is obj
    nxt = cont.next_body(body, 10)
    assert nxt["messages"][-1] == {"role": "assistant", "content": "Hello world"}
    assert nxt["max_tokens"] == nxt["max_completion_tokens"] == 8
    assert body["max_tokens"] == 10 and len(body["messages"]) == 1  # the original stays
    assert cont.rewrite({"id": "b", "created": 2, "choices": [
        {"delta": {"role": "assistant", "content": None}}]}) is None
    out = cont.rewrite({"id": "b", "created": 2, "choices": [
        {"delta": {"content": "Hello world again"}}]})
    assert out is not None and out["id"] == "a" and out["created"] == 1
    assert out["choices"][0]["delta"]["content"] == " again"
    usage = cont.rewrite({"id": "b", "choices": [], "usage": {
        "prompt_tokens": 23, "completion_tokens": 1, "total_tokens": 24}})
    assert usage is not None and usage["usage"] == {
        "prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23}
    assert cont.text == "Hello world again"


def test_a_completion_continuation_extends_the_prompt() -> None:
    cont = Continuation("completions", prompt_tokens=5)
    cont.rewrite({"id": "x", "choices": [{"text": " upon"}]})
    nxt = cont.next_body({"prompt": "Once", "max_tokens": 4}, 4)
    assert nxt["prompt"] == "Once upon" and nxt["max_tokens"] == 3
    cont.rewrite({"id": "y", "choices": [{"text": " a"}]})
    assert cont.text == " upon a" and cont.total_tokens == 2


def test_a_used_up_cap_is_not_continued() -> None:
    cont = Continuation("completions", prompt_tokens=5)
    cont.rewrite({"id": "x", "choices": [{"text": "a"}]})
    with pytest.raises(ValueError):
        cont.next_body({"prompt": "p", "max_tokens": 1}, 1)


def test_reassembled_answer_has_the_non_stream_shape() -> None:
    whole = Reassembler("chat")
    for obj in ({"id": "i", "created": 3, "model": "m", "system_fingerprint": "f",
                 "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
                {"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                          "total_tokens": 4}, "timings": {"x": 1}}):
        whole.feed(obj)
    assert whole.answer() == {
        "choices": [{"finish_reason": "stop", "index": 0,
                     "message": {"role": "assistant", "content": "Hi"}}],
        "created": 3, "model": "m", "system_fingerprint": "f", "object": "chat.completion",
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        "id": "i", "timings": {"x": 1}}


# -- the whole path, over a fake llama-server with a unified pool -----------------------


async def _predictive(harness_factory: Any, fake: Any, **admission: Any) -> Any:
    return await harness_factory(
        {"policy": "predictive", "predict_min_history": 4, "max_queue_wait_s": 60.0,
         **admission}, kv_unified=True, pool_tokens=fake.pool)


def _stream_text(body: str) -> tuple[str, set[str], int, list[Any]]:
    """(content, ids, [DONE] count, error objects) of an SSE chat or completion body."""
    text, ids, done, errors = "", set(), 0, []
    for block in body.split("\n\n"):
        if not block.startswith("data: "):
            continue
        data = block[6:]
        if data == "[DONE]":
            done += 1
            continue
        obj = json.loads(data)
        if "error" in obj:
            errors.append(obj)
            continue
        ids.add(obj.get("id"))
        for choice in obj.get("choices") or []:
            text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    return text, ids, done, errors


async def _warm(h: Any, count: int = 4) -> None:
    """Serve ``count`` short answers so that the prediction starts (answer=5)."""
    for _ in range(count):
        r = await h.chat("warm answer=5", max_tokens=100)
        assert r.status_code == 200, r.text


async def test_short_answers_under_generous_caps_run_together(harness_factory: Any,
                                                              fake: Any) -> None:
    fake.pool, fake.n_ctx, fake.token_delay, fake.tokens = 2048, 2048, 0.002, 10**6
    h = await _predictive(harness_factory, fake)
    await _warm(h)
    fake.peak = 0
    results = await asyncio.gather(*(h.chat("hello answer=5", max_tokens=1024, stream=True)
                                     for _ in range(8)))
    assert all(r.status_code == 200 for r in results)
    assert fake.peak >= 2 and fake.overflows == 0  # strict runs these one at a time
    for r in results:
        text, ids, done, errors = _stream_text(r.text)
        assert text == " t0 t1 t2 t3 t4" and done == 1 and not errors and len(ids) == 1


async def test_long_answers_are_preempted_and_continued_without_overflow(
        harness_factory: Any, fake: Any) -> None:
    fake.pool, fake.n_ctx, fake.token_delay, fake.tokens = 600, 600, 0.001, 10**6
    h = await _predictive(harness_factory, fake)
    await _warm(h)  # predicts 5 tokens, so four 150-token answers are let in at once
    streams = [h.chat(f"go answer=150 n{i}", max_tokens=500, stream=True) for i in range(3)]
    whole = [h.chat(f"go answer=150 w{i}", max_tokens=500) for i in range(2)]
    results = await asyncio.gather(*streams, *whole)
    assert fake.overflows == 0
    assert h.sample("gateway_preemptions_total", backend="local", reason="pool_pressure") > 0
    expected = "".join(f" t{i}" for i in range(150))
    for r in results[:3]:
        text, ids, done, errors = _stream_text(r.text)
        assert r.status_code == 200 and not errors
        assert text == expected and done == 1 and len(ids) == 1
    for r in results[3:]:
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["content"] == expected
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert answer["usage"]["completion_tokens"] == 150
    stats = h.backend.stats()
    await asyncio.sleep(0)
    assert stats.inflight == 0 or h.backend.slot_watch.waiting >= 0
    assert h.sample("gateway_resumes_total", backend="local", outcome="continued") + h.sample(
        "gateway_resumes_total", backend="local", outcome="restarted") == h.sample(
        "gateway_preemptions_total", backend="local", reason="pool_pressure")


async def test_an_overflow_is_recovered_by_continuing(harness_factory: Any,
                                                      fake: Any) -> None:
    """A client outside the gateway holds 700 of the 1200 cells: the backend overflows,
    every stream in flight gets its error event (the outsider's request fails too), and
    the gateway continues each of its own; no client of the gateway sees the error."""
    fake.n_ctx, fake.token_delay, fake.tokens = 1200, 0.001, 10**6
    fake.pool = 1200
    h = await _predictive(harness_factory, fake)
    await _warm(h)
    fake.cells[-1] = 700
    results = await asyncio.gather(*(h.chat(f"go answer=200 n{i}", max_tokens=300,
                                            stream=True) for i in range(3)))
    assert fake.overflows == 1  # the continuations fit once the outsider is gone
    assert h.sample("gateway_preemptions_total", backend="local", reason="overflow") == 3
    expected = "".join(f" t{i}" for i in range(200))
    for r in results:
        text, _ids, done, errors = _stream_text(r.text)
        assert not errors and text == expected and done == 1


async def test_a_completion_stream_is_continued_from_its_partial_text(
        harness_factory: Any, fake: Any) -> None:
    fake.pool, fake.n_ctx, fake.token_delay, fake.tokens = 500, 500, 0.001, 10**6
    h = await _predictive(harness_factory, fake)
    await _warm(h)
    results = await asyncio.gather(*(h.client.post("/v1/completions", json={
        "prompt": f"go answer=140 c{i}", "max_tokens": 400, "stream": True})
        for i in range(3)))
    expected = "".join(f" t{i}" for i in range(140))
    assert fake.overflows == 0
    for r in results:
        text, _ids, done, errors = _stream_text(r.text)
        assert not errors and text == expected and done == 1


async def test_requests_that_cannot_resume_are_charged_their_cap(harness_factory: Any,
                                                                 fake: Any) -> None:
    """Streamed tool calls can be neither continued nor restarted once their first
    event went out: charged their cap, whatever the plain answers' history says."""
    fake.pool, fake.n_ctx, fake.tokens = 2048, 2048, 5
    h = await _predictive(harness_factory, fake)
    await _warm(h)
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    hold = asyncio.Event()
    fake.hold = hold
    first = asyncio.ensure_future(h.chat("x", max_tokens=1500, tools=[tool], stream=True))
    second = asyncio.ensure_future(h.chat("y", max_tokens=1500, tools=[tool], stream=True))
    third = asyncio.ensure_future(h.chat("z answer=5", max_tokens=1500))  # plain: predicted
    for _ in range(50):
        await asyncio.sleep(0.01)
    stats = h.backend.stats()
    assert stats.inflight == 2 and stats.queued == 1  # 1500 + 1500 > 2048: tools wait
    assert 1500 < stats.reserved_tokens < 1600
    hold.set()
    for r in await asyncio.gather(first, second, third):
        assert r.status_code == 200


async def test_no_cap_means_the_room_left_in_the_slot(harness_factory: Any,
                                                      fake: Any) -> None:
    fake.pool, fake.n_ctx, fake.tokens = 2048, 2048, 5
    h = await _predictive(harness_factory, fake)
    r = await h.chat("hello", stream=True)
    assert r.status_code == 200
    sent = fake.generations[-1]
    prompt = int(r.headers["x-gateway-prompt-tokens"])
    assert sent["max_tokens"] == 2048 - 1 - prompt  # not default_max_tokens' 1024
    h2 = await _predictive(harness_factory, fake, default_max_tokens=300)
    await h2.chat("hello")
    assert fake.generations[-1]["max_tokens"] == 300  # an explicit default still applies


async def test_one_overflow_burst_shrinks_the_pool_once_to_what_was_in_use(
        harness_factory: Any, fake: Any) -> None:
    fake.n_ctx = 1000
    h = await harness_factory(pool_tokens=4000)
    h.backend.upstream_failed("context_overflow", live_tokens=2500)
    assert h.backend.admission.layout.pool_tokens == 2500  # more than the 10 % cut
    for _ in range(3):  # the other requests of the same overflow report it too
        h.backend.upstream_failed("context_overflow", live_tokens=2500)
    assert h.backend.admission.layout.pool_tokens == 2500
    h.backend.upstream_failed("context_overflow")
    assert h.backend.admission.layout.pool_tokens == 2500  # still the same burst


# -- found by an adversarial pass ----------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}


async def _settle(h: Any, seconds: float = 4.0) -> Any:
    """Wait for the slot watch to let go; return the final stats."""
    for _ in range(int(seconds / 0.05)):
        stats = h.backend.stats()
        if stats.inflight == 0 and stats.reserved_tokens == 0:
            return stats
        await asyncio.sleep(0.05)
    return h.backend.stats()


def _events(body: str) -> list[Any]:
    out = []
    for block in body.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_queue_progress_stream_is_relayed_as_events(harness_factory: Any,
                                                          fake: Any) -> None:
    """A tracked stream that queued with X-Queue-Progress: 1."""
    fake.pool, fake.n_ctx, fake.tokens = 2048, 2048, 5
    h = await _predictive(harness_factory, fake, queue_progress_s=0.05)
    await _warm(h)
    fake.hold = asyncio.Event()
    blocker = asyncio.ensure_future(h.chat("x", max_tokens=2000, tools=[TOOL]))
    await asyncio.sleep(0.1)
    queued = asyncio.ensure_future(h.client.post(
        "/v1/chat/completions", headers={"X-Queue-Progress": "1"},
        json={"messages": [{"role": "user", "content": "q answer=5"}], "max_tokens": 100,
              "stream": True}))
    await asyncio.sleep(0.2)
    assert h.backend.stats().queued == 1
    fake.hold.set()
    assert (await blocker).status_code == 200
    r = await queued
    text, ids, done, errors = _stream_text(r.text)
    assert text == " t0 t1 t2 t3 t4" and done == 1 and not errors


async def test_client_prefill_survives_a_restart(harness_factory: Any, fake: Any) -> None:
    """The client's own final assistant message (a prefill); the backend overflows at the
    answer's first token (an outsider holds the rest of the pool), so nothing was
    generated yet when the gateway continues it."""
    fake.pool, fake.n_ctx, fake.token_delay, fake.tokens = 1200, 1200, 0.001, 10**6
    h = await _predictive(harness_factory, fake)
    await _warm(h)
    body = {"messages": [{"role": "user", "content": "go answer=5"},
                         {"role": "assistant", "content": "Sure:"}],
            "max_tokens": 100, "stream": True}
    plain = await h.client.post("/v1/chat/completions", json=body)
    assert _stream_text(plain.text)[0] == "Sure: t0 t1 t2 t3 t4"  # no preemption
    prompt = count_words(fake.generations[-1])
    fake.cells[-1] = fake.pool - prompt  # the first token overflows the pool
    r = await h.client.post("/v1/chat/completions", json=body)
    assert h.sample("gateway_preemptions_total", backend="local", reason="overflow") == 1
    text, _ids, done, errors = _stream_text(r.text)
    assert not errors and done == 1
    assert fake.generations[-1]["messages"][-1] == {"role": "assistant", "content": "Sure:"}
    assert text == "Sure: t0 t1 t2 t3 t4"


def _preempting_client(h: Any, marker: bytes) -> Any:
    """A client whose ASGI ``send`` preempts every tracked lease in flight while it
    delivers a body containing ``marker``: what another request's ``observe`` does when
    it runs during that await (each relayed event is awaited under ``asyncio.shield``,
    so other tasks do run there)."""
    admission = h.backend.admission

    async def app(scope: Any, receive: Any, send: Any) -> None:
        async def wrapped(message: Any) -> None:
            await send(message)
            if marker in message.get("body", b""):
                for lease in list(admission._active.values()):
                    if lease.tracked and lease.preemptible:
                        admission.preempt(lease, "pool_pressure")
                await asyncio.sleep(0)
        await h.app(scope, receive, wrapped)

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g")


async def test_a_preemption_after_the_last_token_does_not_continue_a_finished_answer(
        harness_factory: Any, fake: Any) -> None:
    fake.pool, fake.n_ctx, fake.token_delay, fake.tokens = 2048, 2048, 0.001, 10**6
    h = await _predictive(harness_factory, fake)
    await _warm(h)
    client = _preempting_client(h, b'"finish_reason": "stop"')
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "go answer=5"}], "max_tokens": 100,
        "stream": True})
    events = _events(r.text)
    finishes = [e for e in events if isinstance(e, dict)
                and (e.get("choices") or [{}])[0].get("finish_reason")]
    assert len(finishes) == 1 and events[-1] == "[DONE]"
    assert len(fake.generations) == 5  # 4 warm-ups and this one: nothing sent again


async def test_a_preemption_at_the_cap_finishes_with_length(harness_factory: Any,
                                                            fake: Any) -> None:
    fake.pool, fake.n_ctx, fake.token_delay, fake.tokens = 2048, 2048, 0.001, 10**6
    h = await _predictive(harness_factory, fake)
    await _warm(h)
    client = _preempting_client(h, b'"finish_reason": "length"')
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "go answer=50"}], "max_tokens": 2,
        "stream": True})
    text, _ids, done, errors = _stream_text(r.text)
    assert text == " t0 t1" and not errors and done == 1
    whole = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "go answer=50"}], "max_tokens": 1})
    assert whole.status_code == 200


async def test_a_restart_does_not_keep_the_first_attempt_held(harness_factory: Any,
                                                              fake: Any) -> None:
    """Preempted before its first token (least progress: the usual first victim), the
    request is restarted with the same tag and the same cap; the first attempt's slot is
    idle at once, so the slot watch should let its lease go at its next poll (1.5 s)."""
    fake.pool, fake.n_ctx, fake.token_delay, fake.tokens = 2048, 2048, 0.01, 10**6
    h = await _predictive(harness_factory, fake)
    await _warm(h)
    fake.hold = asyncio.Event()
    req = asyncio.ensure_future(h.chat("go answer=400", max_tokens=500, stream=True))
    await asyncio.sleep(0.1)
    admission = h.backend.admission
    (lease,) = admission._active.values()
    admission.preempt(lease, "pool_pressure")  # as check_pressure would
    await asyncio.sleep(0.05)
    fake.hold.set()  # the continuation runs for about 4 s
    await asyncio.sleep(2.5)
    assert not req.done()
    idle = [i for i, s in fake.slot_state.items() if not s["processing"]]
    assert lease.slot_ids[0] in idle
    assert h.backend.slot_watch.waiting == 0 and h.backend.stats().inflight == 1
    r = await req
    assert _stream_text(r.text)[0] == "".join(f" t{i}" for i in range(400))


async def test_a_continuation_is_not_the_first_victim_again() -> None:
    """Least progress first: a continuation that carries 600 tokens of answer in its
    prompt (and adds to it) has more progress than a fresh request ~530 tokens in."""
    clock = ManualClock()
    adm = Admission(Layout(slots=4, ctx_per_slot=2048, pool_tokens=2048), max_queue=4,
                    max_wait_s=30.0, clock=clock, predictive=True)
    victims: list[str] = []
    fresh = adm.try_admit(Charge(700, 1300, predicted=5))
    resumed = adm.try_admit(Charge(700, 900, predicted=5))  # 100 prompt + 600 answered
    resumed.earlier = 600  # tokens its earlier attempt generated (now in its prompt)
    for name, lease in (("fresh", fresh), ("resumed", resumed)):
        lease.tracked = lease.preemptible = True
        lease.on_preempt = lambda reason, name=name: victims.append(name)
    for step in range(1, 1500):
        clock.advance(0.01)
        adm.observe(fresh, step)
        adm.observe(resumed, min(step // 10, 200))
        if victims:
            break
    assert fresh.generated < 600 + resumed.generated
    assert victims[0] == "fresh"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_backend_400_is_passed_on_as_under_strict(harness_factory: Any, fake: Any,
                                                         stream: bool) -> None:
    fake.pool, fake.n_ctx = 2048, 2048
    strict = await harness_factory(kv_unified=True, pool_tokens=fake.pool)
    h = await _predictive(harness_factory, fake)
    fake.mode = "bad_request"  # llama-server's 400 exceed_context_size_error
    want = await strict.chat("hello", max_tokens=10, stream=stream)
    got = await h.chat("hello", max_tokens=10, stream=stream)
    assert want.status_code == 400
    assert got.status_code == want.status_code
    assert "exceeds the available context" in got.text


@pytest.mark.parametrize("policy", ["strict", "predictive"])
async def test_p13_a_long_prefill_keeps_a_progress_stream_alive(
        harness_factory: Any, fake: Any, policy: str) -> None:
    """Shared case P13, point 3: llama-server sends a stream's headers with its first
    token, so a long prefill is minutes of silence, which proxies in front time out. A
    stream that asked for progress gets its 200 and ``: processing prompt`` comments
    until the answer begins, then the answer; one without the header gets nothing early."""
    fake.pool, fake.n_ctx, fake.tokens = 2048, 2048, 3
    h = await harness_factory({"policy": policy, "queue_progress_s": 0.05},
                              kv_unified=True, pool_tokens=2048)
    fake.prepare = asyncio.Event()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}

    async def prefill(event: asyncio.Event, before: int) -> None:
        """A 0.3 s prefill, timed from when the generation reaches the backend (not from
        when the test sends it: on a loaded machine the gateway may take a while)."""
        while len(fake.generations) == before:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.3)
        event.set()

    timer = asyncio.ensure_future(prefill(fake.prepare, len(fake.generations)))
    r = await h.client.post("/v1/chat/completions", json=body,
                            headers={"X-Queue-Progress": "1"})
    await timer
    assert r.status_code == 200
    head, _, rest = r.text.partition("data: ")
    assert head.count(": processing prompt\n\n") >= 3
    assert head.replace(": processing prompt\n\n", "") == ""
    text, _ids, done, errors = _stream_text("data: " + rest)
    assert done == 1 and not errors and text.split() == ["t0", "t1", "t2"]
    fake.prepare = asyncio.Event()
    timer = asyncio.ensure_future(prefill(fake.prepare, len(fake.generations)))
    quiet = await h.client.post("/v1/chat/completions", json=body)
    await timer
    assert quiet.text.startswith("data: ")  # no header asked: nothing before the answer


async def test_a_preempted_stream_is_released_at_a_quick_read_of_the_slots(
        harness_factory: Any, fake: Any) -> None:
    """llama-server ends a cancelled stream at its next write; the continuation waits
    for that release, so /slots is read 0.2 s after a preemption, not 1.5 s."""
    fake.pool, fake.n_ctx, fake.token_delay, fake.tokens = 2048, 2048, 0.01, 10**6
    h = await _predictive(harness_factory, fake)
    await _warm(h)
    req = asyncio.ensure_future(h.chat("go answer=300", max_tokens=500, stream=True))
    admission = h.backend.admission
    for _ in range(100):
        await asyncio.sleep(0.01)
        leases = list(admission._active.values())
        if leases and leases[0].generated >= 3:
            break
    admission.preempt(leases[0], "pool_pressure")
    await asyncio.sleep(0.6)
    assert h.backend.slot_watch.waiting == 0 and not req.done()
    assert h.backend.stats().inflight == 1  # the continuation runs
    text, _ids, done, errors = _stream_text((await req).text)
    assert text == "".join(f" t{i}" for i in range(300)) and done == 1 and not errors


async def test_a_whole_answer_the_pool_overflow_failed_is_sent_again(
        harness_factory: Any, fake: Any) -> None:
    """An untracked whole answer (tools with log-probabilities: not rebuilt from a
    stream) is failed by an overflow before any byte of it was sent: under predictive
    the gateway sends it again instead of passing the 500 on; an overflow that persists
    still ends in 503 after two more tries."""
    fake.pool, fake.n_ctx, fake.tokens = 2048, 2048, 5
    h = await _predictive(harness_factory, fake)
    generate = fake._generate
    failures = [1]

    async def once_overflowing(request: Any) -> Any:
        if failures:
            failures.pop()
            fake.generations.append({})
            return httpx.Response(500, json={"error": {
                "code": 500, "message": "Context size has been exceeded.",
                "type": "server_error"}})
        return await generate(request)

    fake._generate = once_overflowing
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    r = await h.chat("x", max_tokens=50, tools=[tool], logprobs=True)
    assert r.status_code == 200 and len(fake.generations) == 2
    assert h.sample("gateway_resumes_total", backend="local", outcome="restarted") == 1
    fake._generate = generate
    fake.mode = "overflow"
    r = await h.chat("x", max_tokens=50, tools=[tool], logprobs=True)
    assert r.status_code == 503 and len(fake.generations) == 5
    assert h.backend.stats().inflight == 0


# -- structured output: whole answers restarted, not continued ----------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}


def test_structured_whole_answers_are_restartable_and_named_by_their_shape() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for extra, shape in (({"tools": [TOOL]}, "tools"), ({"grammar": "root ::= x"}, "grammar"),
                         ({"json_schema": {"type": "object"}}, "schema"),
                         ({"response_format": {"type": "json_object"}}, "schema"),
                         ({"response_format": {"type": "text"}}, "plain"), ({}, "plain")):
        body = {**chat, **extra}
        assert answer_shape(body) == shape
        assert restartable("chat", body, stream=False)
        assert not restartable("chat", body, stream=True)  # its first event went out
    assert restartable("completions", {"prompt": "x", "grammar": "root ::= x"}, False)
    for not_rebuilt in ({"logprobs": True}, {"n": 2}, {"top_logprobs": 2}):
        assert not restartable("chat", {**chat, "tools": [TOOL], **not_rebuilt}, False)
    assert not restartable("embeddings", {"input": "x"}, False)


def test_a_restart_drops_what_the_earlier_attempt_made() -> None:
    cont = Continuation("chat", prompt_tokens=10, restart=True)
    first = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 50,
             "grammar": "root ::= x"}
    for piece in ("{", "\"a\""):
        cont.rewrite({"choices": [{"index": 0, "delta": {"content": piece}}]})
    cont.rewrite({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": "{"}}]}}]})
    assert cont.total_tokens == 3 and cont.faithful
    body = cont.next_body(first, 50)
    assert body == first and body is not first  # the same request, the whole cap
    assert (cont.text, cont.total_tokens, cont.generated, cont.attempts) == ("", 0, 0, 1)
    out = cont.rewrite({"id": "other", "choices": [{"index": 0, "delta": {"content": "{"}}],
                        "usage": {"completion_tokens": 7}})
    assert out is not None and out["usage"]["completion_tokens"] == 7  # this attempt's


def test_reassembled_tool_calls_have_the_non_stream_shape() -> None:
    """As llama-server streams a tool call (the name and id in the first piece, the
    arguments in fragments) and answers it whole (``content`` null beside the calls)."""
    whole = Reassembler("chat")
    pieces = [{"index": 0, "id": "c1", "type": "function",
               "function": {"name": "get", "arguments": ""}},
              {"index": 0, "function": {"arguments": "{\"city\": "}},
              {"index": 0, "function": {"arguments": "\"Oslo\"}"}},
              {"index": 1, "id": "c2", "type": "function", "function": {"name": "now"}},
              {"index": 1, "function": {"arguments": "{}"}}]
    whole.feed({"id": "i", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                              "content": None}}]})
    for piece in pieces:
        whole.feed({"choices": [{"index": 0, "delta": {"tool_calls": [piece]}}]})
    whole.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    message = whole.answer()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get", "arguments": '{"city": "Oslo"}'},
         "id": "c1"},
        {"type": "function", "function": {"name": "now", "arguments": "{}"}, "id": "c2"}]}
    assert whole.answer()["choices"][0]["finish_reason"] == "tool_calls"


def test_each_answer_shape_keeps_its_own_lengths() -> None:
    lengths = CompletionLengths(quantile=1.0, min_history=2)
    for n in (10, 20):
        lengths.record(n)
    lengths.record(300, "tools")
    assert lengths.predict(1000) == 20 and lengths.predict(1000, "tools") is None
    lengths.record(200, "tools")
    assert lengths.predict(1000, "tools") == 300 and len(lengths) == 4


async def test_structured_whole_answers_run_together_on_their_own_history(
        harness_factory: Any, fake: Any) -> None:
    """Tool calls under generous caps: charged their cap until 4 of them were served
    (the plain answers' history says nothing of theirs), then their own p95, so that
    three run at once where strict would run one; a grammar, unseen, is still charged
    its cap."""
    fake.pool, fake.n_ctx, fake.tokens = 2048, 2048, 5
    h = await _predictive(harness_factory, fake)
    await _warm(h)
    for _ in range(4):
        r = await h.chat("call answer=5", max_tokens=1500, tools=[TOOL])
        assert r.status_code == 200, r.text
    hold = asyncio.Event()
    fake.hold = hold
    calls = [asyncio.ensure_future(h.chat(f"call {i} answer=5", max_tokens=1500,
                                          tools=[TOOL])) for i in range(3)]
    for _ in range(50):
        await asyncio.sleep(0.01)
    stats = h.backend.stats()
    assert stats.inflight >= 2 and stats.reserved_tokens < 100  # strict: one, 1500 + 9
    hold.set()
    for r in await asyncio.gather(*calls):
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == " t0 t1 t2 t3 t4"
    fake.hold = hold = asyncio.Event()
    grammar = asyncio.ensure_future(h.chat("g answer=5", max_tokens=1500,
                                           grammar="root ::= x"))
    for _ in range(20):
        await asyncio.sleep(0.01)
    assert h.backend.stats().reserved_tokens > 1500  # unseen shape: its cap
    hold.set()
    assert (await grammar).status_code == 200
    assert fake.overflows == 0


async def test_a_preempted_structured_whole_answer_restarts_from_the_start(
        harness_factory: Any, fake: Any) -> None:
    """Grammar answers predicted short run long: the pool would run short, so some are
    preempted and sent again from the start (never continued: a grammar restarts from
    its first rule); each client gets its one whole answer, its usage that of the
    attempt it got, and the backend never overflows."""
    fake.pool, fake.n_ctx, fake.token_delay, fake.tokens = 600, 600, 0.001, 10**6
    h = await _predictive(harness_factory, fake)
    for _ in range(4):
        assert (await h.chat("g answer=5", max_tokens=100, grammar="root ::= x")
                ).status_code == 200
    results = await asyncio.gather(*(h.chat(f"g answer=150 w{i}", max_tokens=500,
                                            grammar="root ::= x") for i in range(3)))
    assert fake.overflows == 0
    expected = "".join(f" t{i}" for i in range(150))
    for r in results:
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["choices"][0]["message"]["content"] == expected
        assert answer["usage"]["completion_tokens"] == 150
    restarted = h.sample("gateway_resumes_total", backend="local", outcome="restarted")
    assert restarted > 0
    assert h.sample("gateway_resumes_total", backend="local", outcome="continued") == 0
    assert not any(m.get("role") == "assistant" for g in fake.generations
                   for m in g.get("messages", []))  # never a continuation's prefill
