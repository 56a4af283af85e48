"""The request record: one per request, the access line's fields derived from it, and the
only request facts the scope carries."""

from __future__ import annotations

import re
from pathlib import Path

import gateway
from gateway.observe.logs import ACCESS_FIELDS as LOGGED_FIELDS
from gateway.observe.record import ACCESS_FIELDS, SCOPE_KEY, AccessRecord, record_of

PKG = Path(gateway.__file__).parent


class _Tenant:
    name = "team-a"


def test_the_line_has_the_fields_in_their_order() -> None:
    assert LOGGED_FIELDS is ACCESS_FIELDS
    assert ACCESS_FIELDS == (
        "request_id", "upstream_request_id", "method", "path", "route", "backend", "tenant",
        "status", "reason", "upstream_error", "prompt_tokens", "count_source", "max_tokens",
        "queue_wait_ms", "ttft_ms", "duration_ms", "trace_id")
    line = AccessRecord(method="POST", path="/v1/chat/completions").line("chat")
    assert tuple(line) == ACCESS_FIELDS


def test_a_record_as_written_in_the_line() -> None:
    record = AccessRecord(request_id=b"abc", upstream_id=b"abc-1", method="POST",
                          path="/v1/completions", tenant=_Tenant(), status=200,
                          final_status=499, queue_wait_s=0.01234, ttft_s=None,
                          duration_s=1.5, prompt_tokens=31, count_source="cache",
                          max_tokens=64, forwarded=True, priority="high")
    line = record.line("completions")
    assert line["request_id"] == "abc" and line["upstream_request_id"] == "abc-1"
    assert line["status"] == 499 and line["tenant"] == "team-a"
    assert line["backend"] == "none" and line["route"] == "completions"
    assert line["queue_wait_ms"] == 12.3 and line["ttft_ms"] is None
    assert line["duration_ms"] == 1500.0
    assert (line["prompt_tokens"], line["count_source"], line["max_tokens"]) == (31, "cache", 64)
    assert record.labels("completions") == ("none", "completions", "499", "team-a", "high")


def test_the_upstream_id_is_logged_only_when_forwarded_and_different() -> None:
    assert AccessRecord(request_id=b"a", upstream_id=b"a-1").line("x")[
        "upstream_request_id"] is None
    assert AccessRecord(request_id=b"a", upstream_id=b"a", forwarded=True).line("x")[
        "upstream_request_id"] is None


def test_the_counted_status() -> None:
    assert AccessRecord().counted_status == 499  # nothing sent: the client left
    assert AccessRecord(status=503).counted_status == 503
    assert AccessRecord(status=200, final_status=499).counted_status == 499


def test_record_of_keeps_one_record_per_scope() -> None:
    scope: dict = {"type": "http", "method": "GET", "path": "/health"}
    first = record_of(scope)
    assert record_of(scope) is first and scope["state"] == {SCOPE_KEY: first}
    assert (first.method, first.path) == ("GET", "/health")


def test_nothing_else_carries_request_facts_in_the_scope() -> None:
    # The record is the one place: no module writes starlette's request.state or the
    # scope's state dict by key (the record's own module and the middleware excepted).
    writes = re.compile(r"request\.state\.|scope\[\"state\"\]|\.setdefault\(\"state\"")
    found = []
    for path in PKG.rglob("*.py"):
        if path.relative_to(PKG).as_posix() in ("observe/record.py", "http/middleware.py"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if writes.search(line):
                found.append(f"{path.relative_to(PKG)}:{n}: {line.strip()}")
    assert found == []
