"""Wire-level fidelity (issue 11): what counts as a generated token for TTFT/ITL, prompt
shapes, and multi-choice token counts."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.wire import has_token


@pytest.mark.parametrize("choices,seen", [
    ([{"index": 0, "delta": {"content": "Hi"}}], True),
    ([{"index": 0, "delta": {"reasoning_content": "Let me"}}], True),
    ([{"index": 0, "delta": {"reasoning": "Let me"}}], True),  # vLLM's newer field
    ([{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {
        "arguments": "{\"ci"}}]}}], True),  # a stream of tool-call arguments only
    ([{"index": 0, "delta": {"function_call": {"arguments": "{"}}}], True),
    ([{"index": 0, "text": "once"}], True),
    ([{"index": 0, "delta": {"role": "assistant", "content": ""}}], False),
    ([{"index": 0, "delta": {}, "finish_reason": "stop"}], False),
    ([], False),
    (None, False),
])
def test_any_generated_delta_is_a_token(choices: Any, seen: bool) -> None:
    assert has_token(choices) is seen
