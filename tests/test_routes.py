"""The route table (gateway.wire.routes): what is derived from it, and each route's
parser picked through its entry."""

from __future__ import annotations

import json

import pytest

from gateway.errors import InvalidRequest
from gateway.wire import routes
from gateway.wire.routes import (
    BY_NAME,
    BY_PATH,
    ROUTES,
    Access,
    Api,
    Route,
    RouteSpec,
    access_of,
    api_of,
)
from gateway.wire.shapes import shape_of


def test_the_vocabularies_equal_the_strings_they_replace() -> None:
    assert Api.ollama == "ollama" and f"{Api.anthropic}" == "anthropic"
    assert Route.ollama_chat == "ollama_chat" and {"chat": 1}[Route.chat] == 1
    assert json.dumps({"route": Route.completion}) == '{"route": "completion"}'


def test_every_path_is_in_the_table_once() -> None:
    paths = [path for spec in ROUTES for path in spec.paths]  # aliases too
    assert len(paths) == len(set(paths)) == len(BY_PATH)
    named = [spec.name for spec in ROUTES if spec.parser is not None]
    assert len(named) == len(set(named)) == len(BY_NAME)


def test_the_path_sets_are_derived_from_the_table() -> None:
    assert routes.QUIET_PATHS == {"/health", "/v1/health", "/ready", "/metrics", "/status",
                                  "/status.json"}
    assert routes.PROBE_PATHS == routes.OPEN_PATHS == {"/health", "/v1/health", "/ready"}
    assert routes.STATUS_PATHS == {"/status", "/status.json"}
    assert list(routes.FORWARDED) == [
        "/v1/chat/completions", "/chat/completions", "/v1/completions", "/v1/responses",
        "/responses", "/v1/messages", "/v1/embeddings", "/embedding", "/embeddings",
        "/v1/rerank", "/rerank", "/reranking", "/v1/reranking", "/infill", "/completion",
        "/completions"]
    assert routes.DIRECT == {**routes.FORWARDED, "/api/chat": "ollama_chat",
                             "/api/generate": "ollama_generate"}
    assert routes.LABELS["/status.json"] == "status"
    assert "/api/tags" not in routes.LABELS  # labelled "other"
    assert routes.SERVED.startswith("POST /v1/chat/completions, ")
    assert ", GET /api/tags, GET /api/version, GET /api/ps, " in routes.SERVED
    assert routes.SERVED.endswith(", GET /slots, GET /tools, GET /backends/{name}/metrics")


def test_the_other_modules_use_the_derived_sets() -> None:
    from gateway.admission.tenants import OPEN_PATHS
    from gateway.http.status import STATUS_PATHS
    from gateway.observe import logs

    assert OPEN_PATHS is routes.OPEN_PATHS and STATUS_PATHS is routes.STATUS_PATHS
    assert logs.QUIET_PATHS is routes.QUIET_PATHS


@pytest.mark.parametrize("path,access", [
    ("/health", Access.open), ("/ready", Access.open), ("/metrics", Access.scrape),
    ("/status", Access.status), ("/status.json", Access.status), ("/admin/reload", Access.admin),
    ("/admin/anything", Access.admin), ("/v1/chat/completions", Access.tenant),
    ("/api/tags", Access.tenant), ("/nope", Access.tenant),
    ("/chat/completions", Access.tenant), ("/tokenize", Access.tenant),
    ("/slots/0", Access.tenant), ("/v1/health", Access.open),
    ("/backends/local/metrics", Access.scrape), ("/backends/a/b/metrics", Access.tenant),
])
def test_who_may_call_a_path(path: str, access: Access) -> None:
    assert access_of(path) is access


@pytest.mark.parametrize("path,api", [
    ("/v1/chat/completions", Api.openai), ("/v1/messages", Api.anthropic),
    ("/v1/messages/count_tokens", Api.anthropic), ("/v1/messages/nope", Api.anthropic),
    ("/api/chat", Api.ollama), ("/api/pull", Api.ollama), ("/nope", Api.openai),
    ("/infill", Api.openai),
])
def test_the_error_shape_of_a_path_is_its_routes_api(path: str, api: Api) -> None:
    assert api_of(path) is api and shape_of(path) is api


def test_the_ollama_chat_route_has_one_name() -> None:
    # review P6: /api/chat parsed as route "chat" with api "ollama" while the exchange
    # called it "ollama_chat".
    req = BY_PATH["/api/chat"].parse(json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode())
    assert (req.route, req.api, req.spec.counted_as) == ("ollama_chat", "ollama", "chat")
    assert req.stream  # Ollama streams unless told not to
    gen = BY_PATH["/api/generate"].parse(b'{"model": "m", "prompt": "hi", "context": [1, 2]}')
    assert (gen.route, gen.prompts, gen.extra_prompt_tokens) == ("ollama_generate", ("hi",), 2)


@pytest.mark.parametrize("spec", [s for s in ROUTES if s.parser is not None],
                         ids=lambda s: s.name)
def test_each_parser_keeps_its_spec_and_refuses_a_non_object(spec: RouteSpec) -> None:
    with pytest.raises(InvalidRequest):
        spec.parse(b"[1, 2]")


def test_the_native_completion_route_parses_as_completions_and_keeps_its_name() -> None:
    req = BY_NAME["completion"].parse(b'{"prompt": "hi", "n_predict": 4}')
    assert (req.route, req.max_tokens, req.cap_field) == ("completion", 4, "n_predict")
    assert req.spec.counted_as == "completions" and req.spec.cap_field == "n_predict"


def test_count_tokens_needs_no_cap_but_messages_does() -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    assert BY_NAME["count_tokens"].parse(body).max_tokens is None
    with pytest.raises(InvalidRequest, match="max_tokens is required"):
        BY_NAME["messages"].parse(body)


def test_a_route_without_a_parser_reads_no_body() -> None:
    with pytest.raises(TypeError):
        BY_PATH["/health"].parse(b"{}")


def test_the_app_registers_every_route_of_the_table_and_no_other() -> None:
    """The routes are registered from the table (issue 39): every path of it is on the
    app with its method, and every path the app serves but the admin routes is in it."""
    from prometheus_client import CollectorRegistry

    from gateway.config import load_settings
    from gateway.http.app import create_app

    app = create_app(load_settings(backends=[{"name": "a", "url": "http://127.0.0.1:9"}]),
                     registry=CollectorRegistry(), discover=False)
    served: dict[str, set[str]] = {}
    for route in app.routes:
        path, methods = getattr(route, "path", None), getattr(route, "methods", None)
        if path is not None and methods:
            served.setdefault(path, set()).update(methods)
    for spec in ROUTES:
        for path in spec.paths:
            assert spec.method in served.get(path, set()), (path, spec.method)
    extra = {p for p in served if p not in BY_PATH and not p.startswith(routes.ADMIN_PREFIX)}
    # a backend's own /metrics, and llama-server's routes refused on purpose
    # (gateway.http.side: slot actions, the router's loads, /cors-proxy, the web UI)
    assert extra == {"/backends/{name}/metrics", "/slots/{id_slot}", "/models/load",
                     "/models/unload", "/cors-proxy", "/predict", "/"}
