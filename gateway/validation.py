"""Checks on a client's request before anything is counted, queued or forwarded.

Every failure raises a 4xx :class:`~gateway.errors.ClientError` naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidRequest, UnsupportedMediaType

__all__ = ["ParsedRequest", "check_content_type", "parse_body"]


@dataclass(frozen=True)
class ParsedRequest:
    """A validated OpenAI request.

    :param route: ``"chat"`` or ``"completions"``.
    :param body: the JSON object, as sent (unknown fields kept).
    :param max_tokens: requested output cap in tokens, or ``None``.
    :param n: completions requested (≥ 1).
    :param stream: whether SSE streaming was requested.
    :param cap_field: which field gave ``max_tokens`` (for error messages).
    """

    route: str
    body: dict[str, Any]
    max_tokens: int | None
    n: int
    stream: bool
    cap_field: str = "max_tokens"


def check_content_type(value: str | None) -> None:
    """Accept ``application/json`` (any parameters) or no Content-Type at all.

    :raises UnsupportedMediaType: any other media type (415).
    """
    if value is None:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise UnsupportedMediaType(
            f"Content-Type must be application/json, got {value!r}."
        )


def _int_field(body: dict[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{key} must be an integer, got {value!r}.", param=key)
    if value < minimum:
        raise InvalidRequest(f"{key} must be >= {minimum}, got {value}.", param=key)
    return value


def _check_messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty array.", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object.", param=f"messages[{i}]")
        if not isinstance(message.get("role"), str):
            raise InvalidRequest(
                f"messages[{i}].role must be a string.", param=f"messages[{i}].role"
            )
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequest(
                f"messages[{i}].content must be a string, an array of parts, or null.",
                param=f"messages[{i}].content",
            )


def _check_prompt(body: dict[str, Any]) -> None:
    prompt = body.get("prompt")
    ok = (isinstance(prompt, str) and prompt != "") or (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )
    if not ok:
        raise InvalidRequest(
            "prompt must be a non-empty string or a non-empty array of token ids.",
            param="prompt",
        )


def parse_body(route: str, raw: bytes) -> ParsedRequest:
    """Decode and validate a request body.

    :param route: ``"chat"`` or ``"completions"``.
    :param raw: the body bytes (already size-checked).
    :raises InvalidRequest: not UTF-8, not JSON, not an object, a required field is
        missing or empty, or a field has the wrong type or range.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"The body is not valid UTF-8 (byte {exc.start}).") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"The body is not valid JSON: {exc}.") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The body must be a JSON object.")
    if route == "chat":
        _check_messages(body)
    else:
        _check_prompt(body)
    for key, kind in (("model", str), ("stream", bool), ("stream_options", dict)):
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise InvalidRequest(f"{key} has the wrong type: {body[key]!r}.", param=key)
    max_tokens = _int_field(body, "max_tokens", 1)
    max_completion = _int_field(body, "max_completion_tokens", 1)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise InvalidRequest(
            "max_tokens and max_completion_tokens disagree; send one of them.",
            param="max_tokens",
        )
    n = _int_field(body, "n", 1) or 1
    return ParsedRequest(
        route=route,
        body=body,
        max_tokens=max_tokens if max_tokens is not None else max_completion,
        n=n,
        stream=bool(body.get("stream")),
        cap_field="max_tokens" if max_tokens is not None or max_completion is None
        else "max_completion_tokens",
    )
