"""The pure parts of ``bench/conformance.py`` and its pytest plugin: the cause of a test
lost through the gateway, the comparison of two runs and its report, the gateway's
generated configuration (read by the real settings loader), the access-log reader and
the outcome of a test's reports. The records are shaped as the plugin writes them, the
access lines as the gateway's JSON log writes them (``gateway.observe.logs``). The full
run (llama.cpp's suite, twice) stays out of the suite: it takes most of an hour."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from gateway.config import load_settings

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


conformance = _load("conformance")
plugin = _load("conformance_plugin")


def req(method: str, path: str, status: int, *, reason: str | None = None,
        backend: str = "none") -> dict:
    return {"method": method, "path": path, "status": status, "reason": reason,
            "backend": backend, "upstream_error": None}


def record(nodeid: str, outcome: str, *, message: str = "", requests: list | None = None,
           errors: list | None = None, notes: list | None = None, router: bool = False) -> dict:
    return {"nodeid": nodeid, "outcome": outcome, "message": message,
            "requests": requests or [], "gateway_errors": errors or [], "notes": notes or [],
            "router": router}


def test_a_404_the_failure_names_is_the_route_not_served() -> None:
    rec = record("t", "failed", message="assert 404 == 200\n +  where 404 = ...",
                 requests=[req("GET", "/health", 200), req("POST", "/tokenize", 404)])
    assert conformance.classify(rec) == conformance.Cause("404 route not served",
                                                          "POST /tokenize")


def test_an_answer_the_test_expected_is_not_the_cause() -> None:
    # The test wanted the 401 (no key), then failed on something the log cannot show.
    rec = record("t", "failed", message="assert False\n +  where False = all([True, None])",
                 requests=[req("POST", "/v1/completions", 401, reason="unauthorized"),
                           req("POST", "/v1/completions", 200, backend="llama")],
                 notes=["llama-server listens on 127.0.0.1,::1; the gateway on 127.0.0.1 only"])
    cause = conformance.classify(rec)
    assert cause.kind == "a server flag the gateway does not copy"
    assert "127.0.0.1,::1" in cause.detail


def test_a_relayed_error_is_not_the_gateways_own() -> None:
    rec = record("t", "failed", message="assert 400 == 200",
                 requests=[req("POST", "/completion", 400, backend="llama")])
    assert conformance.classify(rec).kind == "answer differs"


def test_causes_in_their_order() -> None:
    cases = {
        "CORS preflight not answered": record(
            "t", "failed", message="assert 405 == 200",
            requests=[req("OPTIONS", "/completions", 405)]),
        "400 refusal": record(
            "t", "failed", message="Error code: 400 - {'error': ...}",
            requests=[req("POST", "/v1/messages", 400, reason="invalid_request")]),
        "gateway not ready": record(
            "t", "error", message="RuntimeError: gateway not ready within 20 s",
            errors=["gateway not ready within 20 s: ..."]),
        "/metrics is the gateway's own": record(
            "t", "failed", message="assert 'llamacpp:prompt_tokens_total' in ...",
            requests=[req("GET", "/metrics", 200)]),
        "CORS headers missing": record(
            "t", "failed", message="KeyError: 'Access-Control-Allow-Origin'"),
        "connection refused or broken": record(
            "t", "failed", message="requests.exceptions.ConnectionError: Max retries exceeded"),
    }
    assert {kind: conformance.classify(rec).kind for kind, rec in cases.items()} == {
        kind: kind for kind in cases}
    assert conformance.classify(cases["400 refusal"]).detail == \
        "invalid_request: POST /v1/messages"


def test_two_runs_compared_counted_and_reported() -> None:
    direct = [record("a", "passed"), record("b", "passed"), record("c", "failed"),
              record("d", "passed"), record("r", "passed", router=True)]
    gateway = [
        record("a", "failed", message="assert 404 == 200",
               requests=[req("POST", "/chat/completions", 404)]),
        record("b", "passed"), record("c", "passed"),
        record("d", "failed", message="ServerError: (404, {...})",
               requests=[req("POST", "/chat/completions", 404)]),
        record("r", "error", errors=["gateway not ready within 20 s"], router=True),
    ]
    rows = conformance.compare(direct, gateway)
    assert conformance.totals(rows) == {"tests": 4, "passed_direct": 3, "passed_gateway": 2,
                                        "lost": 2, "gained": 1, "router_tests": 1}
    assert conformance.causes(rows) == [
        ("404 route not served", 2, [("POST /chat/completions", 2)])]
    report = conformance.render(rows)
    assert "lost through the gateway 2, gained 1" in report
    assert "   2  404 route not served" in report
    assert "Router mode (issue 27), 1 tests: passed directly 1, through the gateway 0" in report
    data = conformance.summary(rows)
    assert json.loads(json.dumps(data))["causes"][0]["details"] == {"POST /chat/completions": 2}


def test_a_test_missing_from_the_gateway_run_is_lost() -> None:
    rows = conformance.compare([record("a", "passed"), record("b", "passed")],
                               [record("b", "passed")])
    assert rows[0].gateway == "missing"
    assert rows[0].cause == conformance.Cause("not run through the gateway", "-")
    # A direct run alone loses nothing.
    assert conformance.totals(conformance.compare([record("a", "passed")], []))["lost"] == 0


def test_the_generated_config_is_one_the_gateway_loads(tmp_path: Path) -> None:
    toml = plugin.gateway_toml(18001, "http://127.0.0.1:18080", api_key="sk-test",
                               kv_unified=False)
    path = tmp_path / "g.toml"
    path.write_text(toml)
    settings = load_settings(path)
    assert settings.server.port == 18001 and settings.server.log_format == "json"
    assert settings.server.cors_origins == ["*"]  # llama-server's default
    backend = settings.backends[0]
    assert backend.url == "http://127.0.0.1:18080" and backend.unified is False
    assert backend.api_key is not None
    assert settings.tenants[0].key_hashes == [hashlib.sha256(b"sk-test").hexdigest()]
    path.write_text(plugin.gateway_toml(18001, "http://127.0.0.1:18080"))
    assert load_settings(path).tenants == []
    # llama-server's --n-predict, which /props does not show, with a key and without
    for key in ("sk-test", None):
        path.write_text(plugin.gateway_toml(18001, "http://127.0.0.1:18080", api_key=key,
                                            default_max_tokens=64))
        loaded = load_settings(path)
        assert loaded.admission.default_max_tokens == 64
        assert (loaded.backends[0].api_key is not None) is (key is not None)
    # --n-predict -1 (no cap: until the context ends) is the gateway's default cap, not
    # a refused configuration (the suite's test_ctx_shift.py starts servers so)
    path.write_text(plugin.gateway_toml(18001, "http://127.0.0.1:18080",
                                        default_max_tokens=-1))
    uncapped = load_settings(path).admission
    path.write_text(plugin.gateway_toml(18001, "http://127.0.0.1:18080"))
    assert uncapped == load_settings(path).admission
    assert load_settings(path).server.relay_tools is True  # the suite's servers' /tools


def test_the_gateways_cors_follows_the_servers() -> None:
    # --cors-origins as given; localhost by default once tools or MCP servers are on
    # (common/arg.cpp); else llama-server's default, *.
    from types import SimpleNamespace

    assert plugin.server_cors(SimpleNamespace(cors_origins="http://a.example, b")) == (
        "http://a.example", "b")
    assert plugin.server_cors(SimpleNamespace(server_tools="all")) == ("localhost",)
    assert plugin.server_cors(SimpleNamespace(mcp_servers_json="{}")) == ("localhost",)
    assert plugin.server_cors(SimpleNamespace()) == ("*",)
    toml = plugin.gateway_toml(18001, "http://x:1", cors_origins=("localhost",))
    assert 'cors_origins = ["localhost"]' in toml


def test_the_gateway_log_read_back() -> None:
    access = {"time": "t", "level": "INFO", "logger": "gateway.access",
              "message": "GET /cors-proxy 404", "method": "GET",
              "path": "/cors-proxy?url=http://x", "status": 404, "reason": None,
              "backend": "none", "upstream_error": None, "request_id": "r"}
    text = "\n".join([
        json.dumps(access),
        json.dumps({"level": "INFO", "logger": "uvicorn.error", "message": "started"}),
        json.dumps({"level": "ERROR", "logger": "gateway", "message": "discovery failed"}),
        "Traceback (most recent call last):", ""])
    requests, problems = plugin.parse_gateway_log(text)
    assert requests == [req("GET", "/cors-proxy", 404)]
    assert problems == ["discovery failed", "Traceback (most recent call last):"]


def test_a_tests_outcome_from_its_reports() -> None:
    assert plugin.outcome_of([("setup", "passed", False), ("call", "passed", False),
                              ("teardown", "passed", False)]) == "passed"
    assert plugin.outcome_of([("setup", "failed", False), ("teardown", "passed", False)]) \
        == "error"
    assert plugin.outcome_of([("setup", "passed", False), ("call", "failed", False),
                              ("teardown", "passed", False)]) == "failed"
    assert plugin.outcome_of([("setup", "skipped", False), ("teardown", "passed", False)]) \
        == "skipped"
    assert plugin.outcome_of([("setup", "passed", False), ("call", "skipped", True),
                              ("teardown", "passed", False)]) == "xfailed"
    assert plugin.outcome_of([("setup", "passed", False), ("call", "passed", False),
                              ("teardown", "failed", False)]) == "error"


def test_the_default_files_leave_out_what_needs_unavailable_models(tmp_path: Path) -> None:
    unit = tmp_path / "unit"
    unit.mkdir()
    for name in ("test_basic.py", "test_lora.py", "test_vision_api.py", "helpers.py"):
        (unit / name).write_text("")
    assert conformance.default_files(tmp_path) == ["unit/test_basic.py"]
    assert conformance.chosen_files(tmp_path, "test_lora, unit/test_basic.py") == [
        "unit/test_lora.py", "unit/test_basic.py"]


def test_a_gateway_run_repeats_only_what_passed_directly() -> None:
    direct = [record("unit/a.py::t[x y]", "passed"), record("unit/a.py::u", "failed"),
              record("unit/b.py::v", "xpassed"), record("unit/a.py::t[x y]", "passed"),
              record("unit/r.py::w", "passed", router=True), record("unit/b.py::s", "skipped")]
    assert conformance.passed_ids(direct) == ["unit/a.py::t[x y]", "unit/b.py::v",
                                              "unit/r.py::w"]


async def test_a_gateway_before_a_router_with_no_model_counts_as_started() -> None:
    # The suite waits on /health only; the gateway's /ready is 503 on purpose in front of
    # a router that lists no model (docs/differences.md), but every backend was read.
    import contextlib

    from gateway.errors import UpstreamError
    from tests.fake_router import FakeRouter
    from tests.test_router import RouterHarness, harness, two_models

    empty = await harness(FakeRouter({}))
    body = (await empty.client.get("/ready")).json()
    assert body["ready"] is False and plugin.backends_read(body)
    serving = await harness(two_models(loaded={"a"}))
    assert (await serving.client.get("/ready")).status_code == 200
    broken = two_models(loaded={"a"})
    broken.models_json = lambda: {"data": "nope"}  # type: ignore[method-assign]
    unread = RouterHarness(broken)  # its /models unread: its hub has a problem
    with contextlib.suppress(UpstreamError):
        await unread.hub.discover()
    assert not plugin.backends_read((await unread.client.get("/ready")).json())
    assert not plugin.backends_read({"ready": False, "backends": {}})
