"""HTTP routes: the OpenAI-compatible endpoints, health, readiness and metrics."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.app import GatewayState
from gateway.backends import Backend
from gateway.capacity import CapPolicy, Charge, plan_charge
from gateway.errors import (
    BackendNotReady,
    ContextLengthExceeded,
    InvalidRequest,
    PayloadTooLarge,
    UpstreamUnavailable,
    error_body,
)
from gateway.proxy import Exchange, ProxyResponse
from gateway.tokens import chat_text, content_texts, estimate_tokens, tokens_at_least
from gateway.validation import ParsedRequest, check_content_type, parse_body

__all__ = ["register_routes"]


async def read_body(request: Request, limit: int) -> bytes:
    """Read the request body, refusing more than ``limit`` bytes.

    :raises PayloadTooLarge: Content-Length or the bytes read exceed ``limit`` (413).
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The body is {declared} bytes; the limit is {limit} bytes.")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"The body is over the limit of {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


async def _estimate(state: GatewayState, req: ParsedRequest) -> int:
    margin = state.settings.admission.estimate_margin
    if req.route == "chat":
        text, messages = chat_text(req.body)
        return await estimate_tokens(text, messages=messages, margin=margin)
    counts = [len(p) if isinstance(p, tuple) else await estimate_tokens(p, margin=margin)
              for p in req.prompts]
    return max(counts)


async def count_prompt(state: GatewayState, backend: Backend, req: ParsedRequest) -> int:
    """Prompt tokens as the backend counts them (the longest prompt of a batch), else a
    local estimate.

    :raises InvalidRequest: the backend refused the body as a client error (4xx).
    """
    if req.route == "chat":
        counted = await backend.count_prompt("chat", req.body)
    else:
        counts = [await backend.count_prompt("completions", {"prompt": list(p)
                  if isinstance(p, tuple) else p}) for p in req.prompts]
        counted = None if None in counts else max(c for c in counts if c is not None)
    source = "backend"
    if counted is None:
        source, counted = "estimate", await _estimate(state, req)
    state.metrics.token_count_source.labels(backend.name, source).inc()
    return counted


def _prompt_floor(req: ParsedRequest) -> int:
    """Tokens the prompt has at least, from its size alone (no backend call)."""
    if req.route == "completions":
        ids = [len(p) for p in req.prompts if isinstance(p, tuple)]
        texts = [p for p in req.prompts if isinstance(p, str)]
        return max([tokens_at_least(texts), *ids])
    texts = [t for message in req.body["messages"] for t in content_texts(message)]
    return tokens_at_least(["".join(texts)])


def upstream_body(req: ParsedRequest, charge: Charge) -> dict[str, Any]:
    """The body sent upstream: the client's, with the charged cap and usage option set.

    ``max_tokens`` (and ``max_completion_tokens``/``n_predict`` when the client used them)
    become the charged cap, so the backend cannot generate past the reservation. Streams
    get ``stream_options.include_usage = true`` so that completion tokens are known.
    """
    body = dict(req.body)
    body["max_tokens"] = charge.max_tokens
    for alias in ("max_completion_tokens", "n_predict"):
        if alias in body:
            body[alias] = charge.max_tokens
    if req.stream:
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        body["stream_options"] = options
    return body


def register_routes(app: FastAPI, state: GatewayState) -> None:
    """Attach every route of the gateway to ``app``."""
    settings = state.settings

    async def handle(request: Request, route: str) -> Response:
        started = state.clock.now()
        request.state.route = route
        retry = request.headers.get("x-stainless-retry-count", "")
        if retry.isascii() and retry.isdigit():
            attempt = int(retry) if len(retry) < 4 else 999
            if attempt:
                state.metrics.client_retries.labels(str(attempt) if attempt < 10 else "10+").inc()
        check_content_type(
            request.headers.get("content-type"), request.headers.get("content-encoding")
        )
        raw = await read_body(request, settings.server.max_body_bytes)
        req = parse_body(route, raw)
        backend = state.pick_backend(req.body.get("model"))
        request.state.backend = backend.name
        layout = backend.admission.layout
        if layout is None or not backend.ready:
            backend.request_rediscovery()
            why = backend.problem or ("unreachable, loading, or its capacity is not known "
                                      "yet")
            raise BackendNotReady(
                f"Backend {backend.name!r} is not ready ({why}); retry after the Retry-After "
                "delay.",
                retry_after_s=1.0,
            )
        backend.check_token_ids(req.prompts)
        backend.admission.check_queue_room()  # a full queue answers before any counting
        floor = _prompt_floor(req)
        if floor > layout.usable_per_slot:
            raise ContextLengthExceeded(
                f"This prompt has at least {floor} tokens, more than a slot of "
                f"{layout.ctx_per_slot} tokens holds. Shorten the prompt.",
                param="messages" if route == "chat" else "prompt",
            )
        try:
            prompt_tokens = await count_prompt(state, backend, req)
        except UpstreamUnavailable:
            state.metrics.upstream_errors.labels(backend.name, "connect").inc()
            raise
        batch = max(1, len(req.prompts))
        charge = plan_charge(
            layout, prompt_tokens, req.max_tokens, n=req.n * batch,
            default_max_tokens=settings.admission.default_max_tokens,
            policy=CapPolicy(settings.admission.overlong.value), cap_field=req.cap_field,
        )
        extra = [(b"x-gateway-prompt-tokens", str(prompt_tokens).encode())]
        if charge.defaulted:
            state.metrics.default_max_tokens_applied.labels(backend.name).inc()
        if charge.clamped:
            state.metrics.max_tokens_clamped.labels(backend.name).inc()
            extra.append((b"x-gateway-max-tokens-clamped", str(charge.max_tokens).encode()))
        options = req.body.get("stream_options") or {}
        body = upstream_body(req, charge)
        exchange = Exchange(
            backend=backend, route=route, body=body, charge=charge,
            stream=req.stream, started=started,
            headers=list(request.headers.raw),
            client_wants_usage=bool(options.get("include_usage")),
            extra_headers=extra, tag=backend.tag_request(body), prompts=batch,
        )
        return ProxyResponse(exchange, client=state.client, metrics=state.metrics,
                             clock=state.clock)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "completions")

    @app.get("/v1/models")
    async def models() -> Response:
        data: list[Any] = []
        for backend in state.backends.values():
            try:
                resp = await state.client.get(backend.url("/v1/models"), timeout=backend.timeout,
                                              headers=backend.settings.auth_headers)
                data.extend(resp.json().get("data", []))
            except Exception:  # an unreachable backend lists nothing
                continue
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        rows = {}
        for name, b in state.backends.items():
            stats, layout = b.admission.stats(), b.admission.layout
            rows[name] = {
                "ready": b.ready, "kind": b.kind, "slots": stats.slots,
                "ctx_per_slot": stats.ctx_per_slot, "capacity_tokens": stats.capacity_tokens,
                "kv_unified": layout.unified if layout else b.settings.kv_unified,
            }
        ok = any(b.ready for b in state.backends.values())
        return JSONResponse({"ready": ok, "backends": rows}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        err = InvalidRequest(f"{request.method} {request.url.path}: {exc.detail}")
        body = error_body(err)
        body["error"]["code"] = "not_found" if exc.status_code == 404 else "method_not_allowed"
        return JSONResponse(body, exc.status_code, headers=exc.headers)
