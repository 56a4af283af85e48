"""Checks on a client's request before anything is counted, queued or forwarded.

Every failure raises a 4xx :class:`~gateway.errors.ClientError` naming the field.

Besides the OpenAI fields, llama-server reads aliases that change how much KV a request
uses (``tools/server/server-schema.cpp``): ``n_predict`` (takes precedence over
``max_tokens``) and ``n_cmpl`` (over ``n``). They are treated as the same quantities, so
that a client cannot get past its reservation with them; and ``n_probs``/``top_logprobs``
are bounded, since each one multiplies the size of every streamed event.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from gateway.errors import InvalidRequest, UnsupportedMediaType

if TYPE_CHECKING:
    from gateway.wire.routes import Api, Route, RouteSpec

__all__ = ["IMAGE_TOKENS", "ParsedRequest", "check_content_type", "parse_chat",
           "parse_completions", "parse_embeddings", "parse_infill", "parse_messages",
           "parse_ollama_chat", "parse_ollama_generate", "parse_rerank", "parse_responses"]

MAX_TOP_LOGPROBS = 20  # OpenAI's documented maximum for top_logprobs
MAX_N_PROBS = 100  # llama-server n_probs; each adds an entry to every token event
MAX_TOKEN_ID = 2**31 - 1
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_NUMBER_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repeat_penalty", "typical_p", "dynatemp_range", "dynatemp_exponent",
                  "xtc_probability", "xtc_threshold", "dry_multiplier", "dry_base",
                  "mirostat_tau", "mirostat_eta", "top_n_sigma")
INT32 = (-(2**31), 2**31 - 1)
# Integer sampling fields and their bounds: llama-server stores these as int32
# (tools/server/server-schema.cpp, common/common.h); seed as uint32 from an integer that
# OpenAI allows to be any int64.
_INT_FIELDS: dict[str, tuple[int, int]] = {
    "seed": (-(2**63), 2**64 - 1), "top_k": INT32, "min_keep": (0, INT32[1]),
    "n_keep": INT32, "n_discard": INT32, "repeat_last_n": INT32, "mirostat": (0, 2),
    "n_indent": (0, INT32[1]),
    "dry_allowed_length": INT32, "dry_penalty_last_n": INT32,
    "t_max_predict_ms": (0, INT32[1]), "id_slot": INT32,
}
# Any integer in a body must fit what a JSON parser in C++ reads exactly (int64/uint64);
# llama-server's parser refuses larger ones (nlohmann::json reads them as doubles).
_INT_RANGE = (-(2**63), 2**64 - 1)
_LONG_DIGITS = re.compile(rb"\d{19}")  # a number that may be beyond _INT_RANGE
MAX_DEPTH = 64  # objects and arrays nested deeper than this are refused

# Tokens charged per image (or audio clip) where the prompt is estimated: Ollama's own
# truncation heuristic counts 768 per image (server/prompt.go); projectors of larger
# models use up to ~1,600.
IMAGE_TOKENS = 1600
# Chat content parts that carry media, as OpenAI's API reads them: Ollama's /v1 makes
# each image_url part an image of its message (openai/openai.go FromChatRequest) and
# refuses input_audio; llama-server reads both (tools/server/server-common.cpp).
_MEDIA_PARTS = frozenset({"image_url", "input_audio"})


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request of one route.

    :param spec: the route's entry in :data:`gateway.wire.routes.ROUTES`, which gives
        its name (:attr:`route`) and API (:attr:`api`).
    :param body: the JSON object, as sent (unknown fields kept).
    :param max_tokens: requested output cap in tokens, or ``None``.
    :param n: completions requested per prompt (≥ 1).
    :param stream: whether SSE streaming was requested.
    :param cap_field: which field gave ``max_tokens`` (for error messages).
    :param prompts: for completions, the prompts (one, or a batch); empty for chat. Each
        is a string, or a tuple of token ids that may mix in strings.
    :param extra_prompt_tokens: prompt tokens given as ids besides the text (Ollama's
        ``context`` array on ``/api/generate``), and :data:`IMAGE_TOKENS` for each media
        item.
    :param media: how many media items (images, audio clips) the prompt carries: their
        share of ``extra_prompt_tokens`` is a guess, not a count.
    :param texts: for routes without ``messages`` or ``prompt`` (Anthropic messages,
        Responses, infill, rerank), the texts a local estimate reads.
    :param queued_batch: the backend runs the batch's items a slot at a time and queues
        the rest itself (embeddings, rerank), so it takes at most every slot.
    """

    spec: RouteSpec
    body: dict[str, Any]
    max_tokens: int | None
    n: int
    stream: bool
    cap_field: str = "max_tokens"
    prompts: tuple[str | tuple[int | str, ...], ...] = ()
    extra_prompt_tokens: int = 0
    media: int = 0
    texts: tuple[str, ...] = ()
    queued_batch: bool = False

    @property
    def route(self) -> Route:
        """The route's name (``chat``, ``ollama_chat``, …), the same word the exchange,
        the metrics and the backend kinds use."""
        return self.spec.name

    @property
    def api(self) -> Api:
        """The route's API (``openai``, ``anthropic`` or ``ollama``)."""
        return self.spec.api


def check_content_type(value: str | None, encoding: str | None = None) -> None:
    """Accept ``application/json`` (any parameters) or no Content-Type, unencoded.

    :raises UnsupportedMediaType: another media type, or a Content-Encoding (415).
    """
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise UnsupportedMediaType(
            f"Content-Encoding {encoding!r} is not supported; send the JSON body uncompressed."
        )
    if value is None:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise UnsupportedMediaType(f"Content-Type must be application/json, got {value!r}.")


def _int_field(body: dict[str, Any], key: str, minimum: int, maximum: int | None = None
               ) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{key} must be an integer, got {value!r}.", param=key)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise InvalidRequest(f"{key} must be {bound}, got {value}.", param=key)
    return value


def _check_parts(parts: list[Any], where: str) -> None:
    for j, part in enumerate(parts):
        param = f"{where}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise InvalidRequest(f"{param} must be an object with a string type.", param=param)
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{param}.text must be a string.", param=f"{param}.text")


def _check_role_fields(message: dict[str, Any], i: int) -> None:
    """The fields the OpenAI Chat Completions API requires per role (its request schema:
    ``ChatCompletionRequest*Message``): system, developer, user and tool messages need
    ``content``, a tool message also its ``tool_call_id``, and an assistant message
    ``content`` or ``tool_calls`` (or the older ``function_call``). Other roles, which
    some chat templates define, are left to the backend.

    :raises InvalidRequest: a required field is missing or null.
    """
    role = message["role"]
    where = f"messages[{i}]"
    if role in ("system", "developer", "user", "tool") and message.get("content") is None:
        raise InvalidRequest(f"{where}.content is required for a {role} message.",
                             param=f"{where}.content")
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise InvalidRequest(f"{where}.tool_call_id must be a string: a tool message "
                             "answers one tool call.", param=f"{where}.tool_call_id")
    if role == "assistant" and message.get("content") is None and not (
            message.get("tool_calls") or message.get("function_call")):
        raise InvalidRequest(f"{where} needs content or tool_calls (an assistant "
                             "message).", param=f"{where}.content")


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
        if isinstance(content, list):
            _check_parts(content, f"messages[{i}].content")
        elif content is not None and not isinstance(content, str):
            raise InvalidRequest(
                f"messages[{i}].content must be a string, an array of parts, or null.",
                param=f"messages[{i}].content",
            )
        calls = message.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise InvalidRequest(f"messages[{i}].tool_calls must be an array.",
                                 param=f"messages[{i}].tool_calls")
        _check_role_fields(message, i)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools
        ):
            raise InvalidRequest("tools must be an array of {type, function} objects.",
                                 param="tools")


def _token_ids(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, list) and value and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        if not all(0 <= t <= MAX_TOKEN_ID for t in value):
            raise InvalidRequest("prompt token ids must be non-negative vocabulary ids.",
                                 param="prompt")
        return tuple(value)
    return None


def _mixed(value: Any) -> tuple[int | str, ...] | None:
    """One prompt of token ids and texts, as llama-server reads an array with both
    (``json_is_array_of_mixed_numbers_strings``, ``tools/server/server-common.cpp``)."""
    if not isinstance(value, list) or not value:
        return None
    ints = [t for t in value if isinstance(t, int) and not isinstance(t, bool)]
    texts = [t for t in value if isinstance(t, str)]
    if not ints or not texts or len(ints) + len(texts) != len(value):
        return None
    _token_ids(ints)  # the same id bounds
    return tuple(value)


def _object_prompt(value: Any) -> str | None:
    """The text of a prompt given as llama-server's multimodal object,
    ``{"prompt_string": str, "multimodal_data": [base64 strings]}``
    (``tools/server/README.md``, ``/completion``); ``None`` for any other value.

    :raises InvalidRequest: an object with a ``prompt_string`` that is not a string, or
        ``multimodal_data`` that is not an array of strings.
    """
    if not isinstance(value, dict) or "prompt_string" not in value:
        return None
    text, media = value["prompt_string"], value.get("multimodal_data", [])
    if not isinstance(text, str) or not isinstance(media, list) or not all(
            isinstance(m, str) for m in media):
        raise InvalidRequest("A prompt object needs a string prompt_string and, if given, "
                             "multimodal_data as an array of base64 strings.",
                             param="prompt")
    return text


def _media_of(value: Any) -> int:
    """How many media a prompt (or a batch of them) carries in multimodal objects."""
    items = value if isinstance(value, list) else [value]
    return sum(len(p.get("multimodal_data") or []) for p in items
               if isinstance(p, dict) and "prompt_string" in p)


def _prompts(body: dict[str, Any]) -> tuple[str | tuple[int | str, ...], ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return (prompt,)
    ids = _token_ids(prompt) or _mixed(prompt)
    if ids is not None:
        return (ids,)
    text = _object_prompt(prompt)
    if text is not None:
        return (text,)
    if isinstance(prompt, list) and prompt:  # a batch: strings, token-id arrays, objects
        batch: list[str | tuple[int | str, ...]] = []
        for item in prompt:
            ids = _token_ids(item) or _mixed(item)
            text = _object_prompt(item)
            if isinstance(item, str) and item:
                batch.append(item)
            elif ids is not None:
                batch.append(ids)
            elif text is not None:
                batch.append(text)
            else:
                batch = []
                break
        if batch:
            return tuple(batch)
    raise InvalidRequest(
        "prompt must be a non-empty string, an array of token ids (which may mix in "
        "strings), a {prompt_string, multimodal_data} object, or an array of those.",
        param="prompt",
    )


def _check_sampling(body: dict[str, Any], logprobs: type[bool] | type[int]) -> None:
    """The sampling fields' types and bounds; ``logprobs`` is a boolean in chat-like
    APIs (``bool``) and a count of alternatives in completion-like ones (``int``).

    :raises InvalidRequest: a field has the wrong type or is out of its range.
    """
    for key in _NUMBER_FIELDS:
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise InvalidRequest(f"{key} must be a number, got {value!r}.", param=key)
    for key, (low, high) in _INT_FIELDS.items():
        _int_field(body, key, low, high)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
        isinstance(stop, list) and all(isinstance(s, str) for s in stop)
    ):
        raise InvalidRequest("stop must be a string or an array of strings.", param="stop")
    _int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    _int_field(body, "n_probs", 0, MAX_N_PROBS)
    given = body.get("logprobs")
    if logprobs is bool and given is not None and not isinstance(given, bool):
        raise InvalidRequest("logprobs must be a boolean.", param="logprobs")
    if logprobs is int and given is not None:
        _int_field(body, "logprobs", 0, MAX_TOP_LOGPROBS)


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise InvalidRequest(f"The body has a number out of range: {text[:40]}.")
    return value


def _bounded_int(text: str) -> int:
    value = int(text)
    if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
        raise InvalidRequest(
            f"The body has an integer out of the 64-bit range: {text[:40]}"
            f"{'…' if len(text) > 40 else ''}."
        )
    return value


def _check_depth(value: Any) -> None:
    """Refuse objects/arrays nested deeper than :data:`MAX_DEPTH` (iteratively, so that
    no depth can exhaust the stack here or when the body is re-encoded later)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > MAX_DEPTH:
            raise InvalidRequest(f"The body's JSON is nested deeper than {MAX_DEPTH} levels.")
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))


def _reject_constant(name: str) -> Any:
    raise InvalidRequest(f"The body is not valid JSON: {name} is not a JSON number.")


def _decode(raw: bytes) -> Any:
    """The body's JSON. orjson reads most bodies several times faster than the standard
    library and refuses what the gateway refuses (invalid UTF-8, NaN and infinities,
    unpaired surrogate escapes), except integers beyond 64 bits, which it reads as
    floats: a body with a run of 19 digits, and any body orjson refuses, is read by the
    standard library, whose hooks give the precise 400."""
    if _LONG_DIGITS.search(raw) is None:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # the standard library names the problem
        else:
            _check_depth(body)
            return body
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"The body is not valid UTF-8 (byte {exc.start}).") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float,
                          parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"The body is not valid JSON: {exc}.") from None
    except ValueError as exc:  # e.g. an integer longer than Python's digit limit
        raise InvalidRequest(f"The body has a number that cannot be read: {exc}.") from None
    except RecursionError:
        raise InvalidRequest("The body's JSON is nested too deeply.") from None
    _check_depth(body)
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest("The body has an unpaired UTF-16 surrogate escape.") from None
        except RecursionError:
            raise InvalidRequest("The body's JSON is nested too deeply.") from None
    return body


def _same(keys: tuple[str, ...], values: list[int | None]) -> int | None:
    given = [v for v in values if v is not None]
    if len(set(given)) > 1:
        sent = [k for k, v in zip(keys, values, strict=True) if v is not None]
        raise InvalidRequest(f"{' and '.join(sent)} disagree; send one of them.", param=sent[0])
    return given[0] if given else None


def _parse_openai(spec: RouteSpec, raw: bytes, *, chat: bool) -> ParsedRequest:
    """Decode and validate an OpenAI chat (``chat``) or completion body.

    :param raw: the body bytes (already size-checked).
    :raises InvalidRequest: not UTF-8, not JSON (NaN/Infinity included), too deeply
        nested, not an object, a required field missing or empty, or a field with the
        wrong type or range.
    """
    body = _decode(raw)
    if not isinstance(body, dict):
        raise InvalidRequest("The body must be a JSON object.")
    prompts: tuple[str | tuple[int | str, ...], ...] = ()
    if chat:
        _check_messages(body)
    else:
        prompts = _prompts(body)
    for key, kind in (("model", str), ("stream", bool), ("stream_options", dict)):
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise InvalidRequest(f"{key} has the wrong type: {body[key]!r}.", param=key)
    _check_sampling(body, bool if chat else int)
    n_predict = _int_field(body, "n_predict", -1)
    cap_keys = spec.cap_keys  # max_tokens, max_completion_tokens, n_predict
    caps = [None if key == "n_predict" and n_predict in (None, -1) else
            _int_field(body, key, 1) for key in cap_keys]
    max_tokens = _same(cap_keys, caps)
    cap_field = next((k for k, v in zip(cap_keys, caps, strict=True) if v is not None),
                     "max_tokens")
    n = _same(("n", "n_cmpl"), [_int_field(body, "n", 1), _int_field(body, "n_cmpl", 1)])
    media = _chat_media(body) if chat else _media_of(body.get("prompt"))
    return ParsedRequest(
        spec=spec, body=body, max_tokens=max_tokens, n=n or 1,
        stream=bool(body.get("stream")), cap_field=cap_field, prompts=prompts,
        extra_prompt_tokens=media * IMAGE_TOKENS, media=media,
    )


def _chat_media(body: dict[str, Any]) -> int:
    """How many media parts (``image_url``, ``input_audio``) a chat's messages carry."""
    return sum(1 for message in body["messages"]
               if isinstance(message.get("content"), list)
               for part in message["content"] if part.get("type") in _MEDIA_PARTS)


def parse_chat(spec: RouteSpec, raw: bytes) -> ParsedRequest:
    """An OpenAI Chat Completions body: ``messages`` (non-empty, each role's required
    fields), the sampling fields, and the cap in ``max_tokens``,
    ``max_completion_tokens`` or llama-server's ``n_predict`` (they must agree). Each
    ``image_url`` or ``input_audio`` part is charged :data:`IMAGE_TOKENS` besides the
    text, where the prompt is estimated (a backend that counts counts them itself).

    :raises InvalidRequest: see :func:`_parse_openai`.
    """
    return _parse_openai(spec, raw, chat=True)


def parse_completions(spec: RouteSpec, raw: bytes) -> ParsedRequest:
    """An OpenAI Completions body (also llama-server's native ``/completion``): a
    ``prompt`` that is a string, token ids (which may mix in strings), llama-server's
    ``{prompt_string, multimodal_data}`` object, or a batch of those; ``logprobs`` is a
    count of alternatives. Each media item of a prompt object is charged
    :data:`IMAGE_TOKENS` besides its text (the backend refuses media it cannot read).

    :raises InvalidRequest: see :func:`_parse_openai`.
    """
    return _parse_openai(spec, raw, chat=False)


def _ollama_images(value: Any, param: str) -> int:
    """How many images ``images`` has; it must be absent, null or an array of base64
    strings (``api.ImageData``), as Ollama decodes it."""
    if value is None:
        return 0
    if not isinstance(value, list) or not all(isinstance(i, str) for i in value):
        raise InvalidRequest(f"{param} must be an array of base64 strings.", param=param)
    return len(value)


def _ollama_messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if messages is None:
        return  # a request with no messages only loads the model
    if not isinstance(messages, list):
        raise InvalidRequest("messages must be an array.", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a string role.",
                                 param=f"messages[{i}]")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string.",
                                 param=f"messages[{i}].content")
        _ollama_images(message.get("images"), f"messages[{i}].images")


def _ollama_common(raw: bytes) -> tuple[dict[str, Any], int | None]:
    """The fields both of Ollama's native bodies share (``api/types.go``): the body,
    and the cap ``options.num_predict`` as given (``None`` when absent).

    :raises InvalidRequest: no ``model``, ``options`` not an object, or a field of the
        wrong type or range.
    """
    body = _decode(raw)
    if not isinstance(body, dict):
        raise InvalidRequest("The body must be a JSON object.")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise InvalidRequest("model is required.", param="model")
    options = body.get("options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("options must be an object.", param="options")
    options = options or {}
    for key, kind in (("stream", bool), ("truncate", bool), ("raw", bool),
                      ("stream_options", dict)):  # not Ollama's, but the pipeline reads it
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise InvalidRequest(f"{key} has the wrong type: {body[key]!r}.", param=key)
    _check_sampling(options, bool)
    num_predict = _int_field(options, "num_predict", -2, INT32[1])
    _int_field(options, "num_ctx", 1, INT32[1])
    return body, num_predict


def _ollama_request(spec: RouteSpec, body: dict[str, Any], num_predict: int | None,
                    prompts: tuple[str, ...], extra_tokens: int, images: int
                    ) -> ParsedRequest:
    """The cap is ``options.num_predict`` (``-1``/``-2``, "no limit"/"fill the context",
    count as none); ``stream`` defaults to true, as in Ollama; ``images`` of them."""
    return ParsedRequest(
        spec=spec, body=body, max_tokens=None if num_predict in (None, -1, -2, 0)
        else num_predict, n=1, stream=body.get("stream") is not False,
        cap_field="options.num_predict", prompts=prompts,
        extra_prompt_tokens=extra_tokens + images * IMAGE_TOKENS, media=images,
    )


def parse_ollama_chat(spec: RouteSpec, raw: bytes) -> ParsedRequest:
    """A body of Ollama's native ``/api/chat`` (``api/types.go`` ``ChatRequest``): the
    cap is ``options.num_predict`` (``-1``/``-2``, "no limit"/"fill the context", count
    as none); ``stream`` defaults to true, as in Ollama; each image adds
    ``IMAGE_TOKENS``.

    :raises InvalidRequest: as :func:`parse_chat`, for Ollama's fields.
    """
    body, num_predict = _ollama_common(raw)
    _ollama_messages(body)
    images = sum(len(m.get("images") or []) for m in body.get("messages") or [])
    return _ollama_request(spec, body, num_predict, (), 0, images)


def parse_ollama_generate(spec: RouteSpec, raw: bytes) -> ParsedRequest:
    """A body of Ollama's native ``/api/generate`` (``api/types.go``
    ``GenerateRequest``): the ``system``, ``template`` and ``suffix`` texts join the
    prompt, and a ``context`` array of token ids adds its length; each image adds
    ``IMAGE_TOKENS``. The cap and ``stream`` as in :func:`parse_ollama_chat`.

    :raises InvalidRequest: as :func:`parse_completions`, for Ollama's fields.
    """
    body, num_predict = _ollama_common(raw)
    given = [body.get(k) for k in ("system", "template", "prompt", "suffix")]
    if not all(t is None or isinstance(t, str) for t in given):  # null: unset, as in Go
        raise InvalidRequest("prompt, system, template and suffix must be strings.",
                             param="prompt")
    texts = [t or "" for t in given]
    context_tokens = 0
    context = body.get("context")
    if context is not None:
        if not isinstance(context, list) or _token_ids(context) is None and context:
            raise InvalidRequest("context must be an array of token ids.",
                                 param="context")
        context_tokens = len(context)
    images = _ollama_images(body.get("images"), "images")
    prompts = ("\n".join(t for t in texts if t) or " ",)
    return _ollama_request(spec, body, num_predict, prompts, context_tokens, images)


_MEDIA_KEYS = frozenset({"data", "image_url", "file_data", "source"})


def _texts_of(value: Any) -> tuple[list[str], int]:
    """The strings inside a structured prompt (for a local estimate and the size floor),
    and how many media blocks it has: encoded images and files (an Anthropic ``source``,
    a Responses ``image_url``, a data URL) are counted as media, not read as text."""
    out: list[str] = []
    media = 0
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if node.startswith("data:"):
                media += 1
            else:
                out.append(node)
        elif isinstance(node, dict):
            for key, child in node.items():
                if key in _MEDIA_KEYS and not isinstance(child, (int, float, bool)):
                    media += 1
                else:
                    stack.append(child)
        elif isinstance(node, list):
            stack.extend(node)
    return out, media


def _cap(body: dict[str, Any], keys: tuple[str, ...]) -> tuple[int | None, str]:
    """The output cap of a body whose API may carry it in any of ``keys`` (llama-server
    reads ``n_predict``, then ``max_completion_tokens``, then ``max_tokens``, whatever the
    route): the value they agree on, and the field it came from.

    :raises InvalidRequest: a value is not a positive integer, or two disagree.
    """
    values = [None if key == "n_predict" and body.get(key) == -1 else
              _int_field(body, key, 1) for key in keys]
    cap = _same(keys, values)
    field = next((k for k, v in zip(keys, values, strict=True) if v is not None), keys[0])
    return cap, field


def _n(body: dict[str, Any]) -> int:
    """Completions asked for (``n``, or llama-server's ``n_cmpl``)."""
    return _same(("n", "n_cmpl"), [_int_field(body, "n", 1),
                                   _int_field(body, "n_cmpl", 1)]) or 1


def _object(raw: bytes) -> dict[str, Any]:
    body = _decode(raw)
    if not isinstance(body, dict):
        raise InvalidRequest("The body must be a JSON object.")
    # stream_options is read on every route (pipeline.prepare_exchange).
    for key, kind in (("model", str), ("stream", bool), ("stream_options", dict)):
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise InvalidRequest(f"{key} has the wrong type: {body[key]!r}.", param=key)
    return body


def _anthropic_messages(body: dict[str, Any]) -> None:
    """Anthropic Messages: ``messages`` of ``{role, content}`` with content a string or
    an array of typed blocks; ``system`` a string or an array of text blocks. An empty
    ``messages`` is let through, as llama-server answers it (its prompt is the chat
    template's, and the system prompt if any), though Anthropic's API refuses it."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequest("messages must be an array.", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise InvalidRequest(f"messages[{i}] must be an object with role 'user' or "
                                 "'assistant'.", param=f"messages.{i}.role")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(b, dict) and isinstance(b.get("type"), str)
                       and (b["type"] != "text" or isinstance(b.get("text"), str))
                       for b in content):
                raise InvalidRequest(f"messages[{i}].content blocks must be objects with a "
                                     "string type (and a text block a string text).",
                                     param=f"messages.{i}.content")
        elif not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string or an array of "
                                 "content blocks.", param=f"messages.{i}.content")
    system = body.get("system")
    if system is not None and not isinstance(system, str) and not (
            isinstance(system, list) and all(
                isinstance(b, dict) and b.get("type") == "text"
                and isinstance(b.get("text"), str) for b in system)):
        raise InvalidRequest("system must be a string or an array of text blocks.",
                             param="system")


def _generated(body: dict[str, Any], spec: RouteSpec, texts: list[str], *,
               cap: int | None, cap_field: str, media: int = 0) -> ParsedRequest:
    return ParsedRequest(spec=spec, body=body, max_tokens=cap, n=_n(body),
                         stream=bool(body.get("stream")), cap_field=cap_field,
                         texts=tuple(texts), extra_prompt_tokens=media * IMAGE_TOKENS,
                         media=media)


def parse_messages(spec: RouteSpec, raw: bytes) -> ParsedRequest:
    """An Anthropic Messages body (``/v1/messages``, and its ``count_tokens``):
    ``messages`` of ``{role, content}``, ``system``, the sampling fields; the cap
    ``max_tokens`` is required where the route generates (that API requires it).

    :raises InvalidRequest: as :func:`parse_chat`, for Anthropic's fields.
    """
    body = _object(raw)
    _anthropic_messages(body)
    _check_sampling(body, bool)
    cap, cap_field = _cap(body, spec.cap_keys)
    if spec.generates and cap is None:
        raise InvalidRequest("max_tokens is required.", param="max_tokens")
    texts, images = _texts_of([body.get("system"), body["messages"], body.get("tools")])
    return _generated(body, spec, texts, cap=cap, cap_field=cap_field, media=images)


def parse_responses(spec: RouteSpec, raw: bytes) -> ParsedRequest:
    """An OpenAI Responses body: ``input`` (a non-empty string or array of items) is
    required; the cap is ``max_output_tokens`` (or an alias llama-server reads).

    :raises InvalidRequest: as :func:`parse_chat`, for the Responses fields.
    """
    body = _object(raw)
    given = body.get("input")
    if not (isinstance(given, str) and given) and not (isinstance(given, list) and given):
        raise InvalidRequest("input must be a non-empty string or array of items.",
                             param="input")
    _check_sampling(body, bool)
    cap, cap_field = _cap(body, spec.cap_keys)
    texts, images = _texts_of([body.get("instructions"), given, body.get("tools")])
    return _generated(body, spec, texts, cap=cap, cap_field=cap_field, media=images)


# The parts an embeddings entry ``{"content": [...]}`` may hold: llama-server loads the
# media ones and concatenates the text ones (tools/server/server-common.cpp,
# tokenize_oai_content_array and oaicompat_content_load_media).
_EMBEDDING_PARTS = frozenset({"text", "image_url", "input_audio", "input_video",
                              "video_url"})


def _content_entry(value: Any) -> tuple[str, int] | None:
    """An embeddings entry given as OpenAI content, ``{"content": [parts]}``, as
    (its text parts joined with no separator, how many media parts), as llama-server
    reads it (tools/server/server-context.cpp, the embeddings handler); ``None`` for
    any other value.

    :raises InvalidRequest: ``content`` is not an array of typed parts, a part's type is
        unknown, or a text part's ``text`` is not a string.
    """
    if not isinstance(value, dict) or "content" not in value:
        return None
    parts = value["content"]
    if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("type"), str)
            and p["type"] in _EMBEDDING_PARTS for p in parts):
        raise InvalidRequest("An input object's content must be an array of parts of "
                             "type text, image_url, input_audio, input_video or "
                             "video_url.", param="input")
    texts = [p.get("text", "") for p in parts if p["type"] == "text"]
    if not all(isinstance(t, str) for t in texts):
        raise InvalidRequest("A text part's text must be a string.", param="input")
    return "".join(texts), sum(1 for p in parts if p["type"] != "text")


def parse_embeddings(spec: RouteSpec, raw: bytes) -> ParsedRequest:
    """An embeddings body: ``input`` (or llama-server's ``content``), one prompt or a
    batch of them, as completions take, where an entry may also be OpenAI content,
    ``{"content": [text and media parts]}`` (see :func:`_content_entry`); no output,
    so no cap. Each media item is charged :data:`IMAGE_TOKENS` besides its text.

    :raises InvalidRequest: ``input`` is missing or of the wrong shape.
    """
    body = _object(raw)
    given = body.get("input", body.get("content"))
    entries = given if isinstance(given, list) and given and not _token_ids(given) \
        and not _mixed(given) else [given]
    content = [_content_entry(e) for e in entries]
    wrong = InvalidRequest("input must be a non-empty string, an array of token ids, a "
                           "{content: [parts]} object, or an array of those.",
                           param="input")
    items: list[str | tuple[int | str, ...]] = []
    for entry, parts in zip(entries, content, strict=True) if any(content) else ():
        if parts is not None:  # counted as its text; its media are charged apart
            if not parts[0] and not parts[1]:
                raise wrong
            items.append(parts[0])
            continue
        try:  # beside content entries, each other entry is one prompt
            found = _prompts({"prompt": entry})
        except InvalidRequest:
            raise wrong from None
        if len(found) != 1:
            raise wrong
        items.extend(found)
    if not any(content):  # no content entry: the prompts as completions take them
        try:
            items.extend(_prompts({"prompt": given}))
        except InvalidRequest:
            raise wrong from None
    # Counted once every entry is known good (a malformed multimodal_data is a 400 above).
    media = _media_of(given) + sum(c[1] for c in content if c is not None)
    return ParsedRequest(spec=spec, body=body, max_tokens=0, n=1, stream=False,
                         prompts=tuple(items), queued_batch=True,
                         extra_prompt_tokens=media * IMAGE_TOKENS, media=media)


def parse_rerank(spec: RouteSpec, raw: bytes) -> ParsedRequest:
    """A rerank body (llama-server's ``/v1/rerank``): a non-empty ``query`` and
    ``documents`` (or ``texts``) of strings; each document is a prompt with the query.

    :raises InvalidRequest: ``query`` or ``documents`` missing or of the wrong shape.
    """
    body = _object(raw)
    query, documents = body.get("query"), body.get("documents", body.get("texts"))
    if not isinstance(query, str) or not query:
        raise InvalidRequest("query must be a non-empty string.", param="query")
    if not isinstance(documents, list) or not documents or not all(
            isinstance(d, str) for d in documents):
        raise InvalidRequest("documents must be a non-empty array of strings.",
                             param="documents")
    _int_field(body, "top_n", 0)
    return ParsedRequest(spec=spec, body=body, max_tokens=0, n=1, stream=False,
                         prompts=tuple(query + "\n" + d for d in documents),
                         queued_batch=True)


def parse_infill(spec: RouteSpec, raw: bytes) -> ParsedRequest:
    """A body of llama-server's ``/infill``: string ``input_prefix``, ``input_suffix``
    and ``prompt``, ``input_extra`` of ``{filename, text}``; the cap is ``n_predict``
    (or an alias).

    :raises InvalidRequest: a field of the wrong type or range.
    """
    body = _object(raw)
    for key in ("input_prefix", "input_suffix", "prompt"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise InvalidRequest(f"{key} must be a string.", param=key)
    extra = body.get("input_extra")
    if extra is not None and not (isinstance(extra, list) and all(
            isinstance(e, dict) and isinstance(e.get("text", ""), str)
            and isinstance(e.get("filename", ""), str) for e in extra)):
        raise InvalidRequest("input_extra must be an array of {filename, text} objects "
                             "with string values.", param="input_extra")
    _check_sampling(body, int)
    cap, cap_field = _cap(body, spec.cap_keys)
    texts = [body.get(k) or "" for k in ("input_prefix", "input_suffix", "prompt")]
    texts += [str(e.get("text", "")) for e in extra or []]
    return _generated(body, spec, texts, cap=cap, cap_field=cap_field)
