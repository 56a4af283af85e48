"""Bad input gets a 4xx in the OpenAI shape and is never forwarded."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.validation import parse_body
from tests.conftest import Harness

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


async def post(h: Harness, content: bytes, path: str = CHAT, **headers: str) -> Any:
    hdrs = {"content-type": "application/json", **headers}
    return await h.client.post(path, content=content, headers=hdrs)


@pytest.mark.parametrize("body,param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b'"just a string"', None),
    (b"{}", "messages"),
    (b'{"messages": []}', "messages"),
    (b'{"messages": "hi"}', "messages"),
    (b'{"messages": [1]}', "messages[0]"),
    (b'{"messages": [{"content": "x"}]}', "messages[0].role"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "10"}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": true}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -5}',
     "max_completion_tokens"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', "n"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
    (b'{"messages": [{"role": "user", "content": "x"}], "model": 7}', "model"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 5,'
     b' "max_completion_tokens": 6}', "max_tokens"),
])
async def test_bad_chat_bodies_are_400(harness: Harness, body: bytes, param: str | None) -> None:
    r = await post(harness, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_request"
    assert err["param"] == param and err["message"]
    assert harness.fake.generations == []

@pytest.mark.parametrize("body", [
    b"{}", b'{"prompt": ""}', b'{"prompt": []}', b'{"prompt": 5}', b'{"prompt": [1, null]}',
    b'{"prompt": [1, 2.5, "a"]}',
    b'{"prompt": [true]}',
])
async def test_bad_completion_bodies_are_400(harness: Harness, body: bytes) -> None:
    r = await post(harness, body, "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert harness.fake.generations == []


async def test_invalid_utf8_is_400(harness: Harness) -> None:
    r = await post(harness, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}')
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
    assert harness.fake.generations == []


async def test_wrong_content_type_is_415(harness: Harness) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()
    r = await harness.client.post(CHAT, content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert harness.fake.generations == []


async def test_body_over_limit_is_413(harness_factory: Any) -> None:
    h = await harness_factory()
    limit = h.state.settings.server.max_body_bytes
    big = json.dumps({"messages": [{"role": "user", "content": "a" * (limit + 10)}]}).encode()
    r = await post(h, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    assert h.fake.generations == []


async def test_body_over_limit_without_content_length_is_413(harness: Harness) -> None:
    limit = harness.state.settings.server.max_body_bytes

    async def chunks() -> Any:
        for _ in range(limit // 65536 + 2):
            yield b"a" * 65536

    r = await harness.client.post(CHAT, content=chunks(),
                                  headers={"content-type": "application/json"})
    assert r.status_code == 413


async def test_client_errors_are_counted_as_invalid_request(harness: Harness) -> None:
    await post(harness, b"{nope")
    assert harness.sample("gateway_rejections_total", backend="none",
                          reason="invalid_request") == 1
    assert harness.sample("gateway_requests_total", backend="none", route="chat",
                          code="400") == 1


async def test_missing_content_type_is_accepted(harness: Harness) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    r = await harness.client.post(CHAT, content=body.encode())
    assert r.status_code == 200


def test_ids_mixed_with_texts_are_one_prompt() -> None:
    # llama-server reads [2, 818, 5279, "of France", 563] as one prompt (tokenize_mixed).
    req = parse_body("completions", b'{"prompt": [2, 818, 5279, "of France", 563]}')
    assert req.prompts == ((2, 818, 5279, "of France", 563),)
    batch = parse_body("completions", b'{"prompt": [[1, "a"], "b", [3, 4]]}')
    assert batch.prompts == ((1, "a"), "b", (3, 4))
    with pytest.raises(InvalidRequest):
        parse_body("completions", b'{"prompt": [1, -5, "a"]}')
