"""Older llama-server builds (issue 41): what the survey at discovery reads of a build,
the fallbacks it states once, and the builds it refuses, on the fake llama-server with
the routes an older build lacks answering 404 (as b9093's server answers
``/v1/chat/completions/input_tokens``: tools/server/server.cpp registers no such route)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.errors import UpstreamError
from gateway.wire.builds import (
    APPLY_TEMPLATE,
    CHAT_COUNT,
    OLDEST_CHECKED,
    RESPONSES_COUNT,
    SLOTS,
    TOKENIZE,
    read_survey,
)

ALL_THERE = {CHAT_COUNT: 200, RESPONSES_COUNT: 200, APPLY_TEMPLATE: 200, TOKENIZE: 200,
             SLOTS: 200}


def test_a_build_with_every_route_has_no_fallback() -> None:
    report = read_survey(ALL_THERE)
    assert report.fallbacks == () and report.problem is None


@pytest.mark.parametrize("path,status,says", [
    (CHAT_COUNT, 404, "counted with /apply-template then /tokenize"),
    (RESPONSES_COUNT, 404, "Responses prompts are estimated"),
    (SLOTS, 501, "kept for admission.disconnect_grace_s"),
    (SLOTS, 404, "kept for admission.disconnect_grace_s"),
])
def test_each_missing_route_is_one_stated_fallback(path: str, status: int, says: str) -> None:
    report = read_survey({**ALL_THERE, path: status})
    assert report.problem is None
    assert len(report.fallbacks) == 1 and says in report.fallbacks[0]


@pytest.mark.parametrize("missing", [(TOKENIZE,), (CHAT_COUNT, APPLY_TEMPLATE)])
def test_a_build_that_cannot_count_is_refused_naming_the_oldest_checked(
        missing: tuple[str, ...]) -> None:
    report = read_survey({**ALL_THERE, **dict.fromkeys(missing, 404)})
    assert report.problem is not None and OLDEST_CHECKED in report.problem
    assert all(path in report.problem for path in missing)


@pytest.mark.parametrize("status", [None, 500, 503, 401])
def test_an_odd_or_missing_answer_is_never_taken_for_a_missing_route(
        status: int | None) -> None:
    report = read_survey(dict.fromkeys(ALL_THERE, status))
    assert report.fallbacks == () and report.problem is None


async def test_an_older_build_is_served_with_its_fallbacks_said_once(
        harness_factory: Any, fake: Any, caplog: pytest.LogCaptureFixture) -> None:
    fake.missing_routes = {CHAT_COUNT, RESPONSES_COUNT}
    caplog.set_level(logging.WARNING, logger="gateway.backends.target")
    h = await harness_factory(survey=True)
    await h.backend.discover()  # a second discovery says nothing again
    said = [r.getMessage() for r in caplog.records if r.name == "gateway.backends.target"]
    assert len(said) == 2 and all(line.startswith("backend local: no POST ") for line in said)
    r = await h.chat("one two three", max_tokens=5)
    assert r.status_code == 200
    assert h.sample("gateway_token_count_source_total", backend="local",
                    source="backend") == 1  # counted exactly, by /apply-template
    asked = [q.url.path for q in fake.requests]
    assert asked.count(CHAT_COUNT) == 1  # the survey's; chats go straight to the fallback
    status = (await h.client.get("/status.json")).json()
    (row,) = status["backends"]
    assert len(row["fallbacks"]) == 2 and row["problem"] is None


async def test_a_build_that_cannot_count_is_not_used_and_says_why(
        harness_factory: Any, fake: Any) -> None:
    fake.missing_routes = {TOKENIZE}
    h = await harness_factory(discover=False, survey=True)
    with pytest.raises(UpstreamError, match=OLDEST_CHECKED):
        await h.backend.discover()
    ready = await h.client.get("/ready")
    assert ready.status_code == 503
    r = await h.chat("hello", max_tokens=5)
    assert r.status_code == 503 and OLDEST_CHECKED in r.json()["error"]["message"]
    assert not [q for q in fake.requests if q.url.path == "/v1/chat/completions"]


def test_the_docs_table_is_the_committed_build_check() -> None:
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "bench"))
    import json

    import builds  # bench/builds.py
    result = json.loads(builds.RESULT.read_text())
    text = builds.DOC.read_text()
    begin, end = text.index("<!-- builds:begin -->"), text.index("<!-- builds:end -->")
    assert text[begin:end].strip().endswith(builds.table(result).strip())
    versions = [row["version"] for row in result["builds"]]
    assert OLDEST_CHECKED in versions  # the oldest named in messages is one checked


async def test_nothing_listening_on_the_default_port_names_the_announced_one(
        harness_factory: Any, fake: Any) -> None:
    from gateway.errors import UpstreamUnavailable

    fake.mode = "connect"
    h = await harness_factory(discover=False)  # the tests' backend url has port 8080
    with pytest.raises(UpstreamUnavailable, match="9931"):
        await h.backend.discover()
    assert "8080" in h.backend.problem and "9931" in h.backend.problem
    elsewhere = await harness_factory(discover=False, url="http://upstream:18080")
    with pytest.raises(UpstreamUnavailable) as raised:
        await elsewhere.backend.discover()
    assert "9931" not in raised.value.message


RECORDED = sorted((Path(__file__).parent / "data" / "builds").glob("*.json"))


@pytest.mark.parametrize("build", [json.loads(p.read_bytes()) for p in RECORDED],
                         ids=[p.stem for p in RECORDED])
async def test_each_recorded_build_is_discovered_with_its_fallbacks(
        build: dict[str, Any], harness_factory: Any, fake: Any) -> None:
    # What each checked build answered (bench/builds.py kept it): its /props read as
    # the layout, and the routes it lacked (404) turned into the fallbacks the table
    # in docs/builds.md gives, with no refusal.
    fake.props_extra, fake.responses_count_route = build["props"], True
    fake.missing_routes = {p for p, status in build["survey"].items() if status == 404}
    h = await harness_factory(discover=False, survey=True)
    await h.backend.discover()
    expected = read_survey(build["survey"])
    assert expected.problem is None
    assert h.backend.fallbacks == expected.fallbacks
    layout = h.backend.admission.layout
    assert layout.slots == build["props"]["total_slots"]
    assert layout.ctx_per_slot == build["props"]["default_generation_settings"]["n_ctx"]
    r = await h.chat("one two", max_tokens=4)
    assert r.status_code == 200


def test_every_checked_build_has_its_answers_recorded() -> None:
    import json

    root = Path(__file__).resolve().parents[1]
    result = json.loads((root / "bench" / "results" / "builds" / "result.json").read_text())
    assert {row["version"] for row in result["builds"]} == {p.stem for p in RECORDED}
