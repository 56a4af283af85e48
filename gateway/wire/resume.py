"""Continuing a preempted answer where it stopped, and rebuilding whole answers from
streams (the ``predictive`` policy on llama-server).

The gateway follows a tracked request token by token, so it always sends it upstream as
a stream; a client that asked for a whole answer gets one rebuilt from the events by
:class:`Reassembler`, shaped as llama-server shapes its non-streamed answers
(``to_json_oaicompat_chat`` / ``to_json_oaicompat`` in ``tools/server/server-task.cpp``).

When such a request is preempted (or the backend overflowed), it is sent again with what
it had produced so far:

* **chat**: the messages plus the partial answer as a final assistant message, which
  llama-server continues as an assistant prefill (on by default; ``--no-prefill-assistant``
  turns it off). Measured on the build in use: the continuation's first content delta
  repeats the prefilled text before its first new token, so the gateway strips it.
* **completions**: the prompt plus the partial text; nothing is repeated.

In both, the cap is lowered by the tokens already generated, and the continuation's
events are relayed in the same stream with the first attempt's ``id`` and ``created``.

:func:`resumable` says which requests can be continued faithfully. A whole answer that
cannot be continued (structured output: tools, a grammar, a JSON schema) is
:func:`restartable` instead: its client sees nothing before the end, so when it is
preempted it is sent again from the start, the tokens it had made dropped. The others
are charged their whole cap and never preempted.

:func:`answer_shape` names the kind of answer a request asks for (``plain``, ``tools``,
``schema``, ``grammar``): each keeps its own history of completion lengths, since a
tool call's length says nothing of a chat answer's.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

from gateway.wire.routes import Route

__all__ = ["CAP_FIELDS", "Continuation", "Reassembler", "answer_shape", "restartable",
           "resumable"]

log = logging.getLogger(__name__)

CAP_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")
# Fields whose effect a continuation would not reproduce: a grammar or schema restarts
# from its first rule, tool calls and log-probabilities cannot be rebuilt, and several
# choices or prompts share one stream.
_UNRESUMABLE = (
    "tools", "functions", "logprobs", "top_logprobs", "n_probs", "grammar", "json_schema",
    "response_format", "echo", "suffix", "best_of", "logit_bias", "post_sampling_probs",
)


def resumable(route: str, body: dict[str, Any]) -> bool:
    """True when a request of ``route`` (``chat`` or ``completions``) with ``body`` can
    be cancelled and continued with the same result a single run would give: one
    choice, plain text (no tools, grammar, schema, ``response_format`` other than text,
    log-probabilities, ``echo`` or ``suffix``), a string prompt for completions, and for
    chat every message's ``content`` a string or absent (a final assistant message, the
    client's own prefill, is a string too)."""
    if body.get("n", 1) not in (1, None):
        return False
    for name in _UNRESUMABLE:
        value = body.get(name)
        if name == "response_format" and isinstance(value, dict) and value.get(
                "type") == "text":
            continue
        if name == "tools" and value in (None, []):
            continue
        if value not in (None, False):
            return False
    if route == Route.completions:
        return isinstance(body.get("prompt"), str)
    if route != Route.chat:
        return False
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return False
    return all(isinstance(m, dict) and isinstance(m.get("content"), str | None)
               for m in messages)


#: Fields a restart from the start reproduces (the same body is sent again) but a
#: continuation would not: the structure of the answer.
_STRUCTURED = frozenset({"tools", "functions", "grammar", "json_schema", "response_format",
                         "logit_bias"})


def restartable(route: str, body: dict[str, Any], stream: bool) -> bool:
    """True when a request of ``route`` with ``body`` can be preempted and sent again
    from the start without its client noticing: a whole answer (``stream`` false: the
    client sees nothing before it ends) of one choice on ``chat`` or ``completions``
    whose only features a continuation could not carry are its structure (tools, a
    grammar, a JSON schema, ``response_format``, ``logit_bias``); log-probabilities,
    ``echo``, ``suffix`` and ``best_of`` are not rebuilt from a stream, so not those."""
    if stream or route not in (Route.chat, Route.completions):
        return False
    if body.get("n", 1) not in (1, None):
        return False
    return all(body.get(name) in (None, False) for name in _UNRESUMABLE
               if name not in _STRUCTURED)


def answer_shape(body: dict[str, Any]) -> str:
    """The kind of answer ``body`` asks for: ``tools`` (tools or functions offered),
    ``schema`` (``json_schema``, or a ``response_format`` other than text), ``grammar``
    (a GBNF grammar), else ``plain``."""
    if body.get("tools") or body.get("functions"):
        return "tools"
    response_format = body.get("response_format")
    if body.get("json_schema") or (response_format and not (
            isinstance(response_format, dict) and response_format.get("type") == "text")):
        return "schema"
    if body.get("grammar"):
        return "grammar"
    return "plain"


@dataclass
class Continuation:
    """What one answer has produced so far, over its attempts.

    :param route: ``chat`` or ``completions``.
    :param prompt_tokens: the original prompt's tokens (reported in the final usage).
    :param restart: it is not continued but sent again from the start
        (:func:`restartable`): a next attempt drops what the earlier ones made.
    """

    route: str
    prompt_tokens: int
    restart: bool = False
    text: str = ""  # content (chat) or text (completions) relayed so far
    generated: int = 0  # tokens generated by the finished attempts
    attempt_tokens: int = 0  # tokens seen in the current attempt
    attempts: int = 0  # continuations started
    id: str | None = None
    created: Any = None
    reasoning: bool = False  # reasoning_content was streamed: not continued faithfully
    finished: bool = False  # a finish_reason was seen: the answer is over
    finish_reason: str | None = None  # that finish_reason, when it was a string
    _strip: str = ""  # text the continuation will repeat before its new tokens
    _role_sent: bool = False

    @property
    def total_tokens(self) -> int:
        """Tokens generated over all attempts so far."""
        return self.generated + self.attempt_tokens

    @property
    def faithful(self) -> bool:
        """Continuing now (or, for a restart, starting again) would give the answer a
        single run gives."""
        return self.restart or not self.reasoning

    def next_body(self, body: dict[str, Any], cap: int) -> dict[str, Any]:
        """The body of the next attempt from the first attempt's ``body``: the partial
        answer appended, and every cap field the body uses set to what is left of
        ``cap`` (the original cap).

        A :attr:`restart`'s next body is ``body`` itself, with the whole cap: what the
        earlier attempts made is forgotten (their client never saw it).

        :raises ValueError: nothing is left of the cap.
        """
        if self.restart:
            self.attempts += 1
            self.attempt_tokens, self.text, self.finished = 0, "", False
            return copy.deepcopy(body)
        self.generated += self.attempt_tokens
        self.attempt_tokens = 0
        self.attempts += 1
        self.finished = False
        left = cap - self.generated
        if left < 1:
            raise ValueError(f"the cap of {cap} tokens is used up")
        out = copy.deepcopy(body)
        for name in CAP_FIELDS:
            if name in out:
                out[name] = left
        out["max_tokens"] = left
        if self.route == Route.completions:
            out["prompt"] = body["prompt"] + self.text
            return out
        self._strip = self.text
        if not self.text:  # nothing relayed yet: the same request again
            return out
        messages = list(out["messages"])
        if messages and messages[-1].get("role") == "assistant":
            messages.pop()  # the client's prefill: already at the start of self.text
        messages.append({"role": "assistant", "content": self.text})
        out["messages"] = messages
        return out

    def rewrite(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """One event of the current attempt as the client should see it, or ``None`` to
        drop it; counts its tokens. Later attempts get the first ``id`` and ``created``,
        lose their repeated role delta and the prefilled text that starts their content,
        and report usage for the whole answer."""
        if self.id is None:
            self.id, self.created = obj.get("id"), obj.get("created")
        elif self.attempts:
            obj["id"], obj["created"] = self.id, self.created
        usage = obj.get("usage")
        if isinstance(usage, dict) and self.attempts:
            done = self.generated + int(usage.get("completion_tokens") or 0)
            usage.update(prompt_tokens=self.prompt_tokens, completion_tokens=done,
                         total_tokens=self.prompt_tokens + done)
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return obj
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finished = True
            if isinstance(choice["finish_reason"], str):
                self.finish_reason = choice["finish_reason"]
        if self.route == Route.completions:
            text = choice.get("text")
            if isinstance(text, str) and text:
                self.text += text
                self.attempt_tokens += 1
            return obj
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return obj
        if delta.get("reasoning_content"):
            self.reasoning = True
            self.attempt_tokens += 1
        if "role" in delta:
            if self._role_sent:
                delta.pop("role")
                if not delta.get("content") and choice.get("finish_reason") is None and (
                        set(delta) <= {"content"}) and "usage" not in obj:
                    return None
            self._role_sent = True
        if delta.get("tool_calls"):  # a piece of a tool call (a restart's, never continued)
            self.attempt_tokens += 1
        content = delta.get("content")
        if isinstance(content, str) and content:
            self.attempt_tokens += 1
            content = self._unrepeat(content)
            delta["content"] = content
            self.text += content
            if not content and choice.get("finish_reason") is None:
                return None
        return obj

    def _unrepeat(self, content: str) -> str:
        """``content`` without the part of the prefilled text it repeats."""
        if not self._strip:
            return content
        same = 0
        for a, b in zip(self._strip, content, strict=False):
            if a != b:
                break
            same += 1
        if same < min(len(self._strip), len(content)):
            log.warning("a continuation did not repeat its prefill as sent; %d of %d "
                        "characters matched", same, len(self._strip))
            self._strip = ""
            return content[same:]
        self._strip = self._strip[same:]
        return content[same:]


@dataclass
class Reassembler:
    """A whole answer rebuilt from a stream's (rewritten) events, in the shape
    llama-server gives a non-streamed answer of the same route.

    :param route: ``chat`` or ``completions``.
    """

    route: str
    first: dict[str, Any] | None = None
    content: str = ""
    reasoning: str = ""
    finish_reason: Any = None
    usage: Any = None
    timings: Any = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, obj: dict[str, Any]) -> None:
        """Take one event object."""
        if self.first is None:
            self.first = obj
        if obj.get("usage") is not None:
            self.usage = obj["usage"]
        if obj.get("timings") is not None:
            self.timings = obj["timings"]
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        if self.route == Route.completions:
            self.content += choice.get("text") or ""
            return
        delta = choice.get("delta") or {}
        self.content += delta.get("content") or ""
        self.reasoning += delta.get("reasoning_content") or ""
        pieces = delta.get("tool_calls")
        for piece in pieces if isinstance(pieces, list) else ():
            if isinstance(piece, dict):
                self._tool_call(piece)

    def _tool_call(self, piece: dict[str, Any]) -> None:
        """Merge one streamed piece of a tool call (``delta.tool_calls[i]``: its
        ``index``, and the ``id``, ``type``, ``function.name`` of its first piece, then
        ``function.arguments`` a fragment at a time) into :attr:`tool_calls`.

        A piece without a usable ``index`` (llama-server always sends one) goes on with
        the last call, unless it brings an ``id`` other than that call's: a new call. An
        index past the calls seen starts one new call, never a gap of empty ones."""
        calls, index, new_id = self.tool_calls, piece.get("index"), piece.get("id")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            last_id = calls[-1].get("id") if calls else None
            fresh = not calls or (isinstance(new_id, str) and bool(new_id)
                                  and last_id is not None and last_id != new_id)
            index = len(calls) if fresh else len(calls) - 1
        if index >= len(calls):
            index = len(calls)
            calls.append({"type": "function", "function": {"name": "", "arguments": ""}})
        call = calls[index]
        for key in ("id", "type"):
            if isinstance(piece.get(key), str) and piece[key]:
                call[key] = piece[key]
        function = piece.get("function")
        if isinstance(function, dict):
            for key in ("name", "arguments"):
                if isinstance(function.get(key), str):
                    call["function"][key] += function[key]

    def answer(self) -> dict[str, Any]:
        """The whole answer, as a JSON object."""
        first = self.first or {}
        if self.route == Route.completions:
            choice: dict[str, Any] = {"text": self.content, "index": 0, "logprobs": None,
                                      "finish_reason": self.finish_reason}
            kind = "text_completion"
        else:
            message: dict[str, Any] = {"role": "assistant", "content": self.content}
            if self.reasoning:
                message["reasoning_content"] = self.reasoning
            if self.tool_calls:  # as llama-server: no text beside the calls is null
                message["content"] = self.content or None
                message["tool_calls"] = self.tool_calls
            choice = {"finish_reason": self.finish_reason, "index": 0, "message": message}
            kind = "chat.completion"
        out: dict[str, Any] = {"choices": [choice]}
        for key in ("created", "model", "system_fingerprint"):
            if key in first:
                out[key] = first[key]
        out["object"] = kind
        if self.usage is not None:
            out["usage"] = self.usage
        if "id" in first:
            out["id"] = first["id"]
        if self.timings is not None:
            out["timings"] = self.timings
        return out
