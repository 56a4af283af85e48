"""The exact-count cache (issue 13): a prompt the backend already counted is not sent to
be counted again, and the count reused is the backend's own. The upstream here is the
llama-server fake of tests/fakes.py; the real backend's check is in
tests/integration/test_llama_server.py."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.backends.countcache import CountCache
from tests.conftest import Harness

pytestmark = pytest.mark.anyio


def test_keys_ignore_key_order_and_sampling_but_not_the_prompt() -> None:
    cache = CountCache(8)
    base = {"messages": [{"role": "user", "content": "hi"}], "model": "m"}
    key = cache.key("chat", base)
    assert key is not None
    assert cache.key("chat", {"model": "m", "messages": base["messages"]}) == key
    assert cache.key("chat", {**base, "max_tokens": 9, "temperature": 0.2, "seed": 4,
                              "stop": ["\n"]}) == key
    # llama-server's count checks logprobs against stream and tools: those stay keyed
    assert cache.key("chat", {**base, "stream": True}) != key
    assert cache.key("chat", {**base, "logprobs": True}) != key
    assert cache.key("chat", {**base, "messages": [{"role": "user", "content": "hi!"}]}) \
        != key
    assert cache.key("chat", {**base, "tools": []}) != key  # unknown to the list: kept
    assert cache.key("chat", {**base, "model": "other"}) != key
    assert cache.key("messages", base) != key  # another route builds another prompt
    assert cache.key("chat", {**base, "seed": 2**70}) == key  # (seed is not part of it)
    assert cache.key("chat", {**base, "extra": 2**70}) is None  # orjson refuses it
    assert CountCache(0).key("chat", base) is None


def test_the_least_recently_used_count_goes_first() -> None:
    cache = CountCache(2)
    a, b, c = (cache.key("chat", {"prompt": p}) for p in "abc")
    cache.put(a, 1)
    cache.put(b, 2)
    assert cache.get(a) == 1  # a is now the most recent
    cache.put(c, 3)
    assert (cache.get(a), cache.get(b), cache.get(c)) == (1, None, 3)
    assert len(cache) == 2 and (cache.hits, cache.misses) == (3, 1)
    cache.clear()
    assert cache.get(a) is None and len(cache) == 0


def count_calls(h: Harness) -> int:
    return sum(q.url.path == "/v1/chat/completions/input_tokens" for q in h.fake.requests)


async def test_a_prompt_is_counted_by_the_backend_once(harness: Harness) -> None:
    first = await harness.chat("the same prompt", max_tokens=10)
    again = [await harness.chat("the same prompt", max_tokens=n, temperature=t)
             for n, t in ((10, 0.0), (20, 0.7))]
    other = await harness.chat("another prompt", max_tokens=10)
    assert [r.status_code for r in (first, *again, other)] == [200] * 4
    assert count_calls(harness) == 2  # the same prompt once, the other once
    charged = {r.headers["x-gateway-prompt-tokens"] for r in (first, *again)}
    assert charged == {first.headers["x-gateway-prompt-tokens"]}
    assert harness.sample("gateway_token_count_source_total", source="cache") == 2
    assert harness.sample("gateway_token_count_source_total", source="backend") == 2


async def test_a_batch_is_counted_per_prompt_and_reuses_each(harness: Harness) -> None:
    async def complete(prompts: Any) -> Any:
        return await harness.client.post("/v1/completions", json={
            "prompt": prompts, "max_tokens": 4})

    tokenized = lambda: sum(q.url.path == "/tokenize" for q in harness.fake.requests)  # noqa: E731
    assert (await complete(["one two", "three"])).status_code == 200
    assert tokenized() == 2
    r = await complete(["three", "four five six"])  # one prompt kept, one new
    assert r.status_code == 200 and tokenized() == 3
    assert harness.sample("gateway_token_count_source_total", source="cache") == 0
    assert (await complete("one two")).status_code == 200 and tokenized() == 3
    assert harness.sample("gateway_token_count_source_total", source="cache") == 1


async def test_counts_are_asked_again_after_the_backend_was_away(harness: Harness) -> None:
    # A server that comes back may serve another model or template.
    assert (await harness.chat("kept", max_tokens=4)).status_code == 200
    assert (await harness.chat("kept", max_tokens=4)).status_code == 200
    assert count_calls(harness) == 1
    harness.fake.mode = "connect"
    assert (await harness.chat("new", max_tokens=4)).status_code >= 500
    assert not harness.backend.reachable
    harness.fake.mode = "ok"
    await harness.backend.discover()
    assert (await harness.chat("kept", max_tokens=4)).status_code == 200
    assert count_calls(harness) == 3  # kept, new (refused connection), kept again


async def test_a_refused_count_is_not_kept(harness: Harness) -> None:
    harness.fake.count_fails = True
    await harness.chat("x", max_tokens=4)
    await harness.chat("x", max_tokens=4)
    assert harness.sample("gateway_token_count_source_total", source="estimate") == 2
    assert len(harness.backend.counts) == 0


async def test_the_cache_can_be_turned_off(harness_factory: Any) -> None:
    h = await harness_factory({"count_cache_entries": 0})
    for _ in range(3):
        assert (await h.chat("same", max_tokens=4)).status_code == 200
    assert count_calls(h) == 3


async def test_a_count_the_backend_disagrees_with_is_asked_again(harness: Harness,
                                                                  monkeypatch: Any) -> None:
    # The backend now counts otherwise (a new chat template, say, that discovery did not
    # see): its usage disagrees with the kept count, and the prompt is counted afresh.
    import tests.fakes

    assert (await harness.chat("same", max_tokens=4)).status_code == 200
    counting = tests.fakes.count_words
    monkeypatch.setattr(tests.fakes, "count_words", lambda text: counting(text) + 100)
    kept = await harness.chat("same", max_tokens=4)  # charged the old count, once
    again = await harness.chat("same", max_tokens=4)
    assert int(again.headers["x-gateway-prompt-tokens"]) == \
        int(kept.headers["x-gateway-prompt-tokens"]) + 100
    assert count_calls(harness) == 2


async def test_only_the_disagreed_count_is_dropped(harness: Harness) -> None:
    # One prompt whose usage differs (vLLM's truncate_prompt_tokens, say) is counted
    # afresh each time; the other prompts' counts stay kept.
    for text in ("one", "two", "three"):
        assert (await harness.chat(text, max_tokens=4)).status_code == 200
    key = harness.backend.counts.key("chat", {"messages": [
        {"role": "user", "content": "one"}], "max_tokens": 4})
    harness.backend.counts.put(key, 999)
    assert (await harness.chat("one", max_tokens=4)).status_code == 200
    assert len(harness.backend.counts) == 2 and harness.backend.counts.get(key) is None
    for text in ("two", "three"):
        assert (await harness.chat(text, max_tokens=4)).status_code == 200
    assert count_calls(harness) == 3


async def test_a_completion_count_is_checked_against_its_usage(harness: Harness) -> None:
    async def complete() -> Any:
        return await harness.client.post("/v1/completions", json={
            "prompt": "one two three", "max_tokens": 4})

    true_count = int((await complete()).headers["x-gateway-prompt-tokens"])
    key = next(iter(harness.backend.counts._counts))
    harness.backend.counts.put(key, true_count + 700)
    assert int((await complete()).headers["x-gateway-prompt-tokens"]) == true_count + 700
    assert int((await complete()).headers["x-gateway-prompt-tokens"]) == true_count


async def test_counts_are_asked_again_when_the_template_changes(harness: Harness) -> None:
    # llama-server shows its model file, chat template and build in /props.
    harness.fake.props_extra = {"chat_template": "one", "model_path": "m.gguf"}
    await harness.backend.discover()
    assert (await harness.chat("same", max_tokens=4)).status_code == 200
    await harness.backend.discover()  # the same template: the count is kept
    assert (await harness.chat("same", max_tokens=4)).status_code == 200
    assert count_calls(harness) == 1
    harness.fake.props_extra = {"chat_template": "two", "model_path": "m.gguf"}
    await harness.backend.discover()
    assert (await harness.chat("same", max_tokens=4)).status_code == 200
    assert count_calls(harness) == 2
