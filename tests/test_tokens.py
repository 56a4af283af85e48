"""Local estimates: offline tiktoken, the byte bound, chat text extraction."""

from __future__ import annotations

import pytest

from gateway.request.tokens import (
    MESSAGE_OVERHEAD_TOKENS,
    PROMPT_OVERHEAD_TOKENS,
    chat_text,
    estimate_tokens,
    load_encoder,
)

pytestmark = pytest.mark.anyio


def test_offline_encoding_loads_without_network() -> None:
    enc = load_encoder()
    assert enc is not None
    assert enc("hello world") == 2


async def test_estimate_applies_margin_and_overhead() -> None:
    n = await estimate_tokens("hello world", messages=1, margin=1.5, encoder=lambda t: 10)
    assert n == min(11, 15) + PROMPT_OVERHEAD_TOKENS + MESSAGE_OVERHEAD_TOKENS


async def test_byte_bound_caps_the_estimate() -> None:
    text = "é" * 10  # 20 UTF-8 bytes
    n = await estimate_tokens(text, margin=1.0, encoder=lambda t: 1000)
    assert n == 20 + PROMPT_OVERHEAD_TOKENS


async def test_large_text_runs_off_the_event_loop() -> None:
    import threading

    seen: list[str] = []

    def enc(text: str) -> int:
        seen.append(threading.current_thread().name)
        return 1

    await estimate_tokens("x" * 100_000, encoder=enc)
    assert seen and seen[0] != threading.main_thread().name


async def test_estimate_never_below_a_real_bpe_count() -> None:
    enc = load_encoder()
    assert enc is not None
    text = "Grüße aus Köln! 東京は晴れ。 " * 50
    assert await estimate_tokens(text) >= enc(text)


def test_chat_text_includes_parts_tools_and_tool_calls() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "assistant", "content": None,
             "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
    }
    text, n = chat_text(body)
    assert n == 3
    for piece in ("be brief", "look", '"name": "f"', "get_weather"):
        assert piece in text


async def test_without_an_encoding_the_byte_bound_is_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tiktoken

    def broken(name: str) -> None:
        raise ValueError(f"Unknown encoding {name}")

    load_encoder.cache_clear()
    monkeypatch.setattr(tiktoken, "get_encoding", broken)
    try:
        assert load_encoder() is None
        assert await estimate_tokens("héllo") == 6 + PROMPT_OVERHEAD_TOKENS
    finally:
        load_encoder.cache_clear()


async def test_digits_are_not_undercounted() -> None:
    text = "1234567890" * 60  # a per-digit tokenizer makes 600 tokens of this
    assert await estimate_tokens(text, margin=1.0) >= 600
