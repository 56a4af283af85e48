"""The gateway in front of Ollama (``kind = "ollama"``), against the fake in
tests/fake_ollama.py: Ollama cannot run on these machines. Shared cases P03 (busy 503),
P04 (unbounded wait for a loaded model), P05 (silent truncation) and P07 (streamed usage)
are here.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.backends.ollama import Calibration
from gateway.config import load_settings
from gateway.http.app import create_app
from tests.conftest import Harness
from tests.fake_ollama import BUSY, FakeOllama

pytestmark = pytest.mark.anyio
MODEL = "llama3.2:1b"


@pytest.fixture
def ollama() -> FakeOllama:
    return FakeOllama()


@pytest.fixture
async def make(ollama: FakeOllama) -> Any:
    made: list[Harness] = []

    async def build(admission: dict[str, Any] | None = None, **backend: Any) -> Harness:
        settings = load_settings(
            admission={"disconnect_grace_s": 0.0, **(admission or {})},
            backends=[{"name": "ollama", "url": "http://ollama:11434", "kind": "ollama",
                       **backend}])
        app = create_app(settings, http_client=ollama.client(), registry=CollectorRegistry(),
                         discover=False)
        h = Harness(app, ollama)  # type: ignore[arg-type]
        await app.state.gateway.fleet.backends["ollama"].discover()
        made.append(h)
        return h

    yield build
    for h in made:
        await h.client.aclose()


def ndjson(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def sample(h: Harness, name: str, **labels: str) -> float:
    return h.sample(name, backend="ollama", **labels)


async def test_discovery_reads_the_loaded_context_and_configured_slots(make: Any) -> None:
    h = await make(slots=2)
    ready = (await h.client.get("/ready")).json()["backends"]["ollama"]
    assert (ready["kind"], ready["slots"], ready["ctx_per_slot"]) == ("ollama", 2, 4096)
    assert ready["kv_unified"] is False and ready["capacity_tokens"] == 8192


async def test_an_ollama_that_leaves_cached_tokens_out_of_its_count_is_named_once(
        make: Any, ollama: FakeOllama, caplog: pytest.LogCaptureFixture) -> None:
    # Ollama 0.30.0's prompt_eval_count is the llama-server timings' prompt_n alone
    # (cached tokens left out; ollama/ollama#16428 fixed it in 0.30.1).
    caplog.set_level(logging.WARNING, logger="gateway.backends.ollama")
    ollama.version = "0.30.0"
    h = await make()
    await h.state.fleet.backends["ollama"].discover()  # again: no second warning
    warned = [r for r in caplog.records if "0.30.1 or later" in r.getMessage()]
    assert len(warned) == 1 and "backend ollama" in warned[0].getMessage()
    ollama.version = "0.30.1"
    caplog.clear()
    await h.state.fleet.backends["ollama"].discover()
    assert not [r for r in caplog.records if "0.30.1 or later" in r.getMessage()]


async def test_unloaded_model_uses_the_configured_context(make: Any, ollama: FakeOllama
                                                          ) -> None:
    ollama.loaded = False
    h = await make(ctx_per_slot=2048)
    assert h.state.fleet.backends["ollama"].admission.layout.ctx_per_slot == 2048


async def test_native_chat_streams_ndjson_with_the_cap_and_truncate_false(
    make: Any, ollama: FakeOllama
) -> None:
    h = await make()
    r = await h.client.post("/api/chat", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Why is the sky blue?"}],
        "options": {"num_predict": 3}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = ndjson(r.text)
    assert [x["message"]["content"] for x in lines[:-1]] == ["t0 ", "t1 ", "t2 "]
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 3
    sent = ollama.generations[-1]
    assert sent["options"]["num_predict"] == 3 and sent["truncate"] is False
    assert sample(h, "gateway_completion_tokens_sum") == 3
    assert sample(h, "gateway_ttft_seconds_count") == 1
    assert sample(h, "gateway_token_count_source_total", source="estimate") == 1


async def test_native_generate_whole_answer_and_default_cap(make: Any, ollama: FakeOllama
                                                            ) -> None:
    h = await make({"default_max_tokens": 4})
    r = await h.client.post("/api/generate", json={"model": MODEL, "prompt": "Hello there",
                                                   "stream": False})
    assert r.status_code == 200
    body = r.json()
    assert body["done"] is True and body["response"] == "tok tok tok tok "
    assert ollama.generations[-1]["options"]["num_predict"] == 4


async def test_openai_routes_go_through_ollama_v1(make: Any, ollama: FakeOllama) -> None:
    h = await make()
    r = await h.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert ollama.generations[-1]["max_tokens"] == 2
    assert "id_slot" not in ollama.generations[-1] and "n_discard" not in ollama.generations[-1]


async def test_listing_routes_pass_through(make: Any) -> None:
    h = await make()
    assert (await h.client.get("/api/tags")).json()["models"][0]["name"] == MODEL
    assert (await h.client.get("/api/version")).json()["version"] == "0.33.0"
    assert (await h.client.get("/api/ps")).json()["models"][0]["context_length"] == 4096
    show = await h.client.post("/api/show", json={"model": MODEL})
    assert show.json()["model_info"]["general.architecture"] == "llama"


async def test_p04_one_slot_means_one_at_a_time_and_a_bounded_queue(
    make: Any, ollama: FakeOllama
) -> None:
    # Ollama waits on an unbounded semaphore for a loaded model; the gateway sends it one
    # request per slot and bounds the wait.
    ollama.hold = asyncio.Event()
    h = await make({"max_queue": 1})
    body = {"model": MODEL, "prompt": "x", "stream": False}
    first = asyncio.ensure_future(h.client.post("/api/generate", json=body))
    second = asyncio.ensure_future(h.client.post("/api/generate", json=body))
    for _ in range(50):
        await asyncio.sleep(0)
    third = await h.client.post("/api/generate", json=body)
    assert third.status_code == 503 and "queue for this backend is full" in third.json()["error"]
    assert "retry-after" in third.headers
    ollama.hold.set()
    assert [r.status_code for r in await asyncio.gather(first, second)] == [200, 200]
    assert ollama.peak == 1


async def test_p03_busy_503_keeps_retry_after_and_the_native_error_shape(
    make: Any, ollama: FakeOllama
) -> None:
    h = await make()
    ollama.mode = "busy"
    r = await h.client.post("/api/chat", json={"model": MODEL, "stream": False,
                                               "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and BUSY in r.json()["error"]
    assert isinstance(r.json()["error"], str) and "retry-after" in r.headers
    v1 = await h.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert v1.status_code == 503 and v1.json()["error"]["code"] == "backend_unavailable"


async def test_p05_a_prompt_over_the_slot_is_refused_not_truncated(
    make: Any, ollama: FakeOllama
) -> None:
    h = await make()
    long = "word " * 5000  # over the 4096-token slot by any count
    r = await h.client.post("/api/chat", json={
        "model": MODEL, "messages": [{"role": "user", "content": long}], "stream": False})
    assert r.status_code == 400 and "4096" in r.json()["error"]
    r = await h.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": long}]})
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert ollama.generations == []


async def test_p05_ollamas_own_over_length_400_is_context_length_exceeded(
    make: Any, ollama: FakeOllama
) -> None:
    ollama.num_ctx = 8192
    h = await make(ctx_per_slot=8192)  # seen loaded with 8192 ...
    ollama.loaded = False
    ollama.parameters = {"num_ctx": 4096}  # ... and loaded again with 4096 since
    await h.state.fleet.backends["ollama"].discover()
    r = await h.client.post("/api/generate", json={
        "model": MODEL, "prompt": "word " * 5000, "stream": False,
        "options": {"num_predict": 10}})
    assert r.status_code == 400 and "exceeds the context length" in r.json()["error"]
    assert ollama.generations[-1]["truncate"] is False


async def test_suspected_truncation_is_counted(make: Any, ollama: FakeOllama) -> None:
    h = await make()
    ollama.num_ctx = 300  # Ollama's real context is smaller than the gateway believes
    msgs = [{"role": "user", "content": "word " * 200} for _ in range(3)]
    r = await h.client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": msgs, "max_tokens": 2})
    assert r.status_code == 200  # the fake's /v1 route drops old messages silently
    assert sample(h, "gateway_suspected_truncations_total") == 1


async def test_model_load_is_waited_for(make: Any, ollama: FakeOllama) -> None:
    ollama.loaded, ollama.load_delay = False, 0.05
    h = await make(ctx_per_slot=4096)
    r = await h.client.post("/api/generate", json={"model": MODEL, "prompt": "hi",
                                                   "stream": False})
    assert r.status_code == 200 and ollama.loaded


async def test_unknown_model_gets_ollamas_404(make: Any) -> None:
    h = await make()
    r = await h.client.post("/api/generate", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and "not found" in r.json()["error"]


async def test_native_errors_of_the_gateway_take_the_native_shape(make: Any) -> None:
    h = await make()
    r = await h.client.post("/api/chat", json={"messages": []})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)


async def test_calibration_uses_a_high_quantile_of_the_observed_ratio() -> None:
    cal = Calibration()
    assert cal.factor("m", 1.25) == 1.25  # until MIN_SAMPLES
    for i in range(100):
        cal.observe("m", 100, 100 + (30 if i == 50 else i % 10))
    factor = cal.factor("m", 1.25)
    assert 1.09 * 1.02 <= factor < 1.3 * 1.02  # covers all but the top 1 %
    assert cal.factor("other", 1.25) == 1.25


async def test_the_ollama_client_library_works_unchanged(make: Any) -> None:
    import ollama as ollama_lib

    h = await make()
    client = ollama_lib.AsyncClient(host="http://gateway",
                                    transport=httpx.ASGITransport(app=h.app))
    reply = await client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                              options={"num_predict": 2})
    assert reply.message.content == "tok tok " and reply.done
    parts = [p async for p in await client.generate(model=MODEL, prompt="hi", stream=True,
                                                     options={"num_predict": 3})]
    assert "".join(p.response for p in parts) == "t0 t1 t2 " and parts[-1].eval_count == 3
    assert (await client.list()).models[0].model == MODEL
    assert (await client.ps()).models[0].context_length == 4096
    with pytest.raises(ollama_lib.ResponseError) as err:
        await client.generate(model="missing", prompt="hi")
    assert err.value.status_code == 404


async def test_p07_streamed_usage_only_when_asked_but_always_counted(
    make: Any, ollama: FakeOllama
) -> None:
    h = await make()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "stream": True}
    plain = await h.client.post("/v1/chat/completions", json=body)
    assert "usage" not in plain.text and plain.text.rstrip().endswith("data: [DONE]")
    asked = await h.client.post("/v1/chat/completions",
                                json={**body, "stream_options": {"include_usage": True}})
    events = [json.loads(e[6:]) for e in asked.text.split("\n\n")
              if e.startswith("data: {")]
    assert [e for e in events if "usage" in e][-1]["usage"]["completion_tokens"] == 3
    assert ollama.generations[0]["stream_options"]["include_usage"] is True
    assert sample(h, "gateway_completion_tokens_sum") == 6


async def test_generate_counts_suffix_template_and_images(make: Any, ollama: FakeOllama
                                                          ) -> None:
    # Fourth adversarial pass: these were not counted, or images counted as text.
    h = await make()
    plain = await h.client.post("/api/generate", json={"model": MODEL, "prompt": "hi",
                                                       "stream": False})
    base = int(plain.headers["x-gateway-prompt-tokens"])
    suffix = await h.client.post("/api/generate", json={
        "model": MODEL, "prompt": "hi", "suffix": "word " * 300, "stream": False})
    assert int(suffix.headers["x-gateway-prompt-tokens"]) >= base + 300
    image = "A" * 400_000  # base64 of a 300 KB picture
    chat = await h.client.post("/api/chat", json={"model": MODEL, "stream": False,
                                                  "messages": [{"role": "user",
                                                                "content": "hi",
                                                                "images": [image]}]})
    assert chat.status_code == 200
    assert 1600 <= int(chat.headers["x-gateway-prompt-tokens"]) < 1700


async def test_a_client_num_ctx_is_replaced_by_the_loaded_one(make: Any, ollama: FakeOllama
                                                              ) -> None:
    h = await make()
    r = await h.client.post("/api/chat", json={
        "model": MODEL, "stream": False, "options": {"num_ctx": 131072},
        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    assert ollama.generations[-1]["options"]["num_ctx"] == 4096


async def test_a_configured_context_stands_beside_a_small_embedding_model() -> None:
    # Two models loaded: the chat model at 8192, an embedding model at 512. The smallest
    # would cap every chat at 511 tokens; a configured ctx_per_slot is the operator's pick.
    from gateway.backends import SideCalls
    from gateway.backends.ollama import Ollama
    from gateway.config import BackendSettings

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/version":
            return httpx.Response(200, json={"version": "0.33.0"})
        return httpx.Response(200, json={"models": [
            {"name": "llama3.2:1b", "context_length": 8192},
            {"name": "nomic-embed-text", "context_length": 512}]})

    client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    for configured, expected in ((8192, 8192), (None, 512)):
        settings = BackendSettings(name="o", kind="ollama", ctx_per_slot=configured)
        found = await Ollama(settings, SideCalls(settings, client)).discover()
        assert found.ctx_per_slot == expected


# -- issue 27: the model unloaded, /api/show before the first load, images on every route


def long_chat(words: int, turns: int = 1, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "word " * words}
                                         for _ in range(turns)], **extra}


def shows(ollama: FakeOllama) -> int:
    return sum(r.url.path == "/api/show" for r in ollama.requests)


async def test_an_over_long_prompt_after_the_model_unloaded_is_refused_not_forwarded(
        make: Any, ollama: FakeOllama) -> None:
    # Loaded with num_ctx 2048; after keep_alive Ollama unloads it (/api/ps empty) and
    # loads it again with 2048 at the next request, dropping what does not fit.
    ollama.num_ctx = 2048
    h = await make()
    assert (await h.client.post("/v1/chat/completions", json=long_chat(5, max_tokens=2))
            ).status_code == 200
    ollama.time += ollama.keep_alive_s + 1
    assert (await h.client.get("/api/ps")).json()["models"] == []
    await h.state.fleet.backends["ollama"].discover()
    assert h.state.fleet.backends["ollama"].admission.layout.ctx_per_slot == 2048
    sent = len(ollama.generations)
    r = await h.client.post("/v1/chat/completions", json=long_chat(1000, 3, max_tokens=2))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "2048" in r.json()["error"]["message"]
    native = await h.client.post("/api/chat", json=long_chat(1000, 3, stream=False))
    assert native.status_code == 400 and "2048" in native.json()["error"]
    assert len(ollama.generations) == sent  # neither was forwarded
    # Straight to the fake, the same chat loads the model and is cut silently: a 200.
    async with ollama.client() as raw:
        cut = await raw.post("http://ollama:11434/v1/chat/completions",
                             json=long_chat(1000, 3, max_tokens=2))
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] < 2048


async def test_a_request_keep_alive_of_zero_unloads_at_once(make: Any, ollama: FakeOllama
                                                            ) -> None:
    ollama.num_ctx = 2048
    h = await make()
    r = await h.client.post("/api/generate", json={"model": MODEL, "prompt": "hi",
                                                   "stream": False, "keep_alive": 0})
    assert r.status_code == 200 and not ollama.loaded
    await h.state.fleet.backends["ollama"].discover()
    assert h.state.fleet.backends["ollama"].admission.layout.ctx_per_slot == 2048


async def test_a_model_never_loaded_takes_its_context_from_api_show(
        make: Any, ollama: FakeOllama) -> None:
    ollama.loaded = False
    ollama.parameters = {"num_ctx": 2048, "stop": ["<|eot_id|>"]}
    h = await make(model=MODEL)
    backend = h.state.fleet.backends["ollama"]
    assert backend.admission.layout.ctx_per_slot == 2048 and shows(ollama) == 1
    await backend.discover()
    assert shows(ollama) == 1  # read once
    r = await h.client.post("/v1/chat/completions", json=long_chat(3000, max_tokens=2))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert ollama.generations == []


async def test_api_show_without_num_ctx_is_bounded_by_the_trained_context(
        make: Any, ollama: FakeOllama) -> None:
    # No num_ctx in the Modelfile: the server's default (4096), at most the model's
    # trained 1024; the model then loads with exactly that (/api/ps agrees).
    ollama.loaded, ollama.parameters, ollama.context_length = False, {}, 1024
    h = await make(model=MODEL)
    backend = h.state.fleet.backends["ollama"]
    assert backend.admission.layout.ctx_per_slot == 1024
    assert (await h.client.post("/api/generate", json={
        "model": MODEL, "prompt": "hi", "stream": False})).status_code == 200
    assert (await h.client.get("/api/ps")).json()["models"][0]["context_length"] == 1024


async def test_a_model_ollama_runs_alone_has_one_slot(make: Any, ollama: FakeOllama) -> None:
    # qwen3vl is loaded with num_parallel 1 whatever OLLAMA_NUM_PARALLEL says, and a
    # vision model gets at least 2048 of context (server/sched.go).
    ollama.loaded, ollama.family = False, "qwen3vl"
    ollama.parameters = {"num_ctx": 1024}
    ollama.capabilities = ["completion", "vision"]
    h = await make(model=MODEL, slots=4)
    layout = h.state.fleet.backends["ollama"].admission.layout
    assert (layout.slots, layout.ctx_per_slot) == (1, 2048)


async def test_shown_context_reads_ollamas_show_answer(ollama: FakeOllama) -> None:
    from gateway.backends.ollama import shown_context

    ollama.parameters = {"num_ctx": 8192, "stop": ["<|eot_id|>", "<|eom_id|>"],
                         "temperature": 0.6}
    async with ollama.client() as raw:
        show = (await raw.post("http://ollama:11434/api/show", json={"model": MODEL})).json()
    assert "num_ctx                        8192" in show["parameters"]
    assert shown_context(show) == (8192, False)
    assert shown_context({**show, "parameters": "stop \"x\""}, default=32768) == (32768, False)
    assert shown_context({**show, "capabilities": ["embedding"]}) == (8192, True)
    small = {**show, "model_info": {"general.architecture": "llama",
                                    "llama.context_length": 2048}}
    assert shown_context(small) == (2048, False)
    vision = {"parameters": "num_ctx 1", "capabilities": ["completion", "vision"]}
    assert shown_context(vision) == (2048, False)
    with pytest.raises(ValueError):
        shown_context([])  # type: ignore[arg-type]


def image_chat(images: int, **extra: Any) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "What is in these pictures?"}]
    parts += [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 800}}
              for _ in range(images)]
    return {"model": MODEL, "messages": [{"role": "user", "content": parts}], **extra}


async def test_images_on_v1_are_charged_and_what_cannot_fit_is_refused(
        make: Any, ollama: FakeOllama) -> None:
    ollama.num_ctx = 2048
    h = await make()
    r = await h.client.post("/v1/chat/completions", json=image_chat(3, max_tokens=10))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    native = await h.client.post("/api/chat", json={
        "model": MODEL, "stream": False, "messages": [{
            "role": "user", "content": "What is in these pictures?",
            "images": ["A" * 800] * 3}]})
    assert native.status_code == 400 and isinstance(native.json()["error"], str)
    assert ollama.generations == []
    one = await h.client.post("/v1/chat/completions", json=image_chat(1, max_tokens=10))
    assert one.status_code == 200 and int(one.headers["x-gateway-prompt-tokens"]) >= 1600


async def test_images_and_a_cap_past_the_context_follow_the_overlong_policy(
        make: Any, ollama: FakeOllama) -> None:
    # Two images (1,600 each) fit a 3,600-token slot; with max_tokens 600 they do not.
    ollama.num_ctx = 3600
    h = await make()
    r = await h.client.post("/v1/chat/completions", json=image_chat(2, max_tokens=600))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "max_tokens" and ollama.generations == []
    clamped = await make({"overlong": "clamp"})
    r = await clamped.client.post("/v1/chat/completions", json=image_chat(2, max_tokens=600))
    assert r.status_code == 200
    sent = ollama.generations[-1]["max_tokens"]
    assert 0 < sent < 600 and int(r.headers["x-gateway-prompt-tokens"]) + sent <= 3599


async def test_a_request_naming_no_model_gets_the_configured_one_or_a_400(
        make: Any, ollama: FakeOllama) -> None:
    """Found by the adversarial pass: a chat without "model" was reserved, forwarded, and
    answered Ollama's 404 (model "None" not found)."""
    h = await make(model=MODEL)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = await h.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert ollama.generations[-1]["model"] == MODEL
    sent = len(ollama.generations)
    r = await h.client.post("/api/chat", json={  # Ollama's own API requires it, as Ollama
        "messages": body["messages"], "stream": False, "options": {"num_predict": 2}})
    assert r.status_code == 400 and r.json() == {"error": "model is required."}
    unnamed = await make()  # serves whichever model each request names
    r = await unnamed.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model" and len(ollama.generations) == sent
    assert sample(unnamed, "gateway_kv_reserved_tokens") == 0
