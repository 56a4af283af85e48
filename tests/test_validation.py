"""Bad input gets a 4xx in the OpenAI shape and is never forwarded."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.errors import InvalidRequest
from gateway.wire.routes import BY_NAME
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
    req = BY_NAME["completions"].parse(b'{"prompt": [2, 818, 5279, "of France", 563]}')
    assert req.prompts == ((2, 818, 5279, "of France", 563),)
    batch = BY_NAME["completions"].parse(b'{"prompt": [[1, "a"], "b", [3, 4]]}')
    assert batch.prompts == ((1, "a"), "b", (3, 4))
    with pytest.raises(InvalidRequest):
        BY_NAME["completions"].parse(b'{"prompt": [1, -5, "a"]}')


# -- body decoding: orjson first, the standard library for what it cannot settle -------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=12)


def _stdlib_reading(raw: bytes) -> Any:
    """What the gateway read before orjson: the standard library with its hooks."""
    from gateway.wire.validation import _INT_RANGE

    def bounded(text: str) -> int:
        value = int(text)
        if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            raise InvalidRequest("out of range")
        return value

    return json.loads(raw, parse_int=bounded)


@given(value=_JSON)
def test_bodies_read_as_the_standard_library_reads_them(value: Any) -> None:
    from gateway.wire.validation import _decode

    raw = json.dumps({"v": value}).encode()
    try:
        expected = _stdlib_reading(raw)
    except InvalidRequest:
        with pytest.raises(InvalidRequest):
            _decode(raw)
        return
    decoded = _decode(raw)
    assert decoded == expected
    assert json.dumps(decoded) == json.dumps(expected)  # ints stay ints, floats floats


@pytest.mark.parametrize("raw,ok", [
    (b'{"n": 18446744073709551615}', True),  # 2**64 - 1: the largest accepted
    (b'{"n": 18446744073709551616}', False),
    (b'{"n": 123456789012345678901234567890}', False),  # orjson alone: a float
    (b'{"n": -9223372036854775808}', True),
    (b'{"n": 1e999}', False), (b'{"n": NaN}', False),
    (b'{"s": "\\ud800"}', False), (b'{"s": "\\ud83d\\ude00"}', True),
    (b'\xef\xbb\xbf{}', False), (b'{"a": 1, "a": 2}', True),
])
def test_what_each_reader_refuses_is_refused(raw: bytes, ok: bool) -> None:
    from gateway.wire.validation import _decode

    if ok:
        assert _decode(raw) == json.loads(raw)
    else:
        with pytest.raises(InvalidRequest):
            _decode(raw)
