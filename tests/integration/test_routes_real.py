"""Issue 11: every generation route of llama-server under admission, against the real
server and model. The gateway's count must equal the backend's own figure, streams must
pass through event by event, and the real SDKs must work unchanged."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer
from tests.integration.conftest import GatewayThread

pytestmark = [pytest.mark.llama]

ANTHROPIC = {"model": "local", "max_tokens": 4, "system": "Be brief.",
             "messages": [{"role": "user", "content": "Say hi."}]}


def events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: {")]


@pytest.fixture(scope="module")
def gw(default_server: LlamaServer) -> Any:
    with GatewayThread({"url": default_server.url}) as thread:
        yield thread


def test_anthropic_messages_counted_exactly_whole_and_streamed(
    gw: GatewayThread, default_server: LlamaServer
) -> None:
    r = httpx.post(gw.url + "/v1/messages", json=ANTHROPIC, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    reported = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
    assert int(r.headers["x-gateway-prompt-tokens"]) == reported
    direct = httpx.post(default_server.url + "/v1/messages/count_tokens", json=ANTHROPIC,
                        timeout=60).json()["input_tokens"]
    counted = httpx.post(gw.url + "/v1/messages/count_tokens", json=ANTHROPIC, timeout=60)
    assert counted.json() == {"input_tokens": direct} == {"input_tokens": reported}
    s = httpx.post(gw.url + "/v1/messages", json={**ANTHROPIC, "stream": True}, timeout=120)
    kinds = [e["type"] for e in events(s.text)]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "event: content_block_delta" in s.text  # the event lines pass through


def test_anthropic_errors_take_anthropics_shape(gw: GatewayThread) -> None:
    r = httpx.post(gw.url + "/v1/messages", json={**ANTHROPIC, "max_tokens": None},
                   timeout=60)
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "max_tokens is required."}}
    r = httpx.post(gw.url + "/v1/messages", json={**ANTHROPIC, "max_tokens": 10**6},
                   timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_the_anthropic_sdk_works_unchanged(gw: GatewayThread) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=gw.url, api_key="unused")
    reply = client.messages.create(**ANTHROPIC)
    assert reply.usage.output_tokens == 4 and reply.content[0].type == "text"
    with client.messages.stream(**ANTHROPIC) as stream:
        text = "".join(stream.text_stream)
    assert text
    assert client.messages.count_tokens(model="local", system="Be brief.", messages=[
        {"role": "user", "content": "Say hi."}]).input_tokens > 0
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(**{**ANTHROPIC, "max_tokens": 9000})


def test_responses_counted_exactly_and_the_openai_sdk_works(gw: GatewayThread) -> None:
    import openai

    body = {"input": "Say hi.", "instructions": "Be brief.", "max_output_tokens": 4}
    r = httpx.post(gw.url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert int(r.headers["x-gateway-prompt-tokens"]) == r.json()["usage"]["input_tokens"]
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused")
    reply = client.responses.create(model="local", input="Say hi.", max_output_tokens=4)
    assert reply.usage.output_tokens == 4
    streamed = list(client.responses.create(model="local", input="Say hi.",
                                            max_output_tokens=4, stream=True))
    assert streamed[-1].type == "response.completed"


def test_native_completion_counted_exactly_whole_and_streamed(gw: GatewayThread) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 3}
    r = httpx.post(gw.url + "/completion", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert int(r.headers["x-gateway-prompt-tokens"]) == r.json()["tokens_evaluated"]
    assert r.json()["tokens_predicted"] == 3
    before = gw.metric("gateway_ttft_seconds_count", backend="local")
    s = httpx.post(gw.url + "/completion", json={**body, "stream": True}, timeout=120)
    assert events(s.text)[-1]["stop"] is True
    assert gw.metric("gateway_ttft_seconds_count", backend="local") == before + 1
    assert gw.metric("gateway_upstream_errors_total", backend="local",
                     kind="stream_aborted") == 0


def test_a_streamed_native_batch_counts_every_prompt(gw: GatewayThread) -> None:
    before = gw.metric("gateway_completion_tokens_sum", backend="local")
    s = httpx.post(gw.url + "/completion", json={"prompt": ["Once upon", "The sky"],
                                                 "n_predict": 3, "stream": True}, timeout=120)
    assert sum(e["stop"] for e in events(s.text)) == 2
    assert gw.metric("gateway_completion_tokens_sum", backend="local") == before + 6
    assert gw.metric("gateway_upstream_errors_total", backend="local",
                     kind="stream_aborted") == 0


@pytest.mark.parametrize("path,body", [
    ("/v1/embeddings", {"input": ["hello", "world"]}),
    ("/v1/rerank", {"query": "a", "documents": ["b", "c"]}),
    ("/infill", {"input_prefix": "def f(", "input_suffix": "):\n", "n_predict": 4}),
])
def test_a_feature_the_server_lacks_relays_its_501(gw: GatewayThread, path: str,
                                                    body: dict[str, Any]) -> None:
    # Without --embeddings or --reranking, and on a model with no FIM tokens.
    r = httpx.post(gw.url + path, json=body, timeout=60)
    assert r.status_code == 501 and r.json()["error"]["message"]
    assert gw.metric("gateway_kv_reserved_tokens", backend="local") == 0


def test_embeddings_with_the_feature_on(llama_parts: tuple[Any, Any]) -> None:
    binary, model = llama_parts
    server = LlamaServer(["--embeddings", "--pooling", "mean", "-c", "2048"], binary=binary,
                         model=model)
    with server.running(), GatewayThread({"url": server.url}) as gw:
        body = {"input": ["The capital of France", "is Paris, a city of two million"]}
        r = httpx.post(gw.url + "/v1/embeddings", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 2
        longest = max(len(httpx.post(server.url + "/tokenize", json={
            "content": text, "add_special": True}, timeout=30).json()["tokens"])
            for text in body["input"])
        assert int(r.headers["x-gateway-prompt-tokens"]) == longest
        # An input over the physical batch (512) can never be embedded: a 400, not a 502
        # that SDKs would retry.
        big = httpx.post(gw.url + "/v1/embeddings", json={"input": "word " * 900},
                         timeout=120)
        assert big.status_code == 400 and "too large" in big.json()["error"]["message"]
        assert gw.metric("gateway_upstream_errors_total", backend="local",
                         kind="status_5xx") == 0
        assert gw.metric("gateway_kv_reserved_tokens", backend="local") == 0


def test_an_unknown_path_lists_the_routes(gw: GatewayThread) -> None:
    r = httpx.post(gw.url + "/v1/nope", json={}, timeout=30)
    assert r.status_code == 404 and "POST /v1/messages" in r.json()["error"]["message"]
