"""The request pipeline: read → parse → tenant → route (pick the backends, check the
queue's room) → shape → count → candidates (plan the charge on each backend) → charge the
tenant → an :class:`~gateway.request.exchange.Exchange` ready to be admitted and forwarded.

Every step raises a :class:`~gateway.errors.GatewayError` that the app renders; nothing
here waits for capacity (that is the :class:`~gateway.relay.response.ProxyResponse`'s job).
The pipeline reads only the parts of the gateway's state that :class:`Planning` names
(:class:`~gateway.fleet.state.GatewayState` has them all).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, Protocol, runtime_checkable

from starlette.requests import Request

from gateway.admission.tenants import PRIORITY_HEADER, Tenant, Tenants, TokenHold
from gateway.backends.target import Target, upstream_body
from gateway.backends.upstream import never_reached
from gateway.clock import Clock
from gateway.config import STRICT_DEFAULT_MAX_TOKENS, Settings
from gateway.core.capacity import plan_charge
from gateway.core.fairness import Party
from gateway.core.prefix import Prefix, prefix_of
from gateway.errors import (
    BackendNotReady,
    ContextLengthExceeded,
    GatewayError,
    InvalidRequest,
    PayloadTooLarge,
    ShuttingDown,
    UpstreamKind,
)
from gateway.fleet.fleet import RouteCounter
from gateway.fleet.pool import AdmitPath, Candidate, LoneBackend, ModelQueue, affinity_key
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.record import AccessRecord, record_of
from gateway.request.exchange import Exchange
from gateway.request.tokens import chat_text, content_texts, estimate_tokens, tokens_at_least
from gateway.wire.naming import ECHOED_NAME_MAX, answer_name, served_name
from gateway.wire.resume import answer_shape, restartable, resumable
from gateway.wire.routes import BY_NAME, Api
from gateway.wire.slo import parse_ttft_deadline
from gateway.wire.validation import ParsedRequest, check_content_type

__all__ = ["Backends", "Planning", "count_prompt", "estimate_prompt", "prepare_exchange",
           "read_body", "require_ready"]


class Backends(Protocol):
    """Which backends a request may go to (:class:`gateway.fleet.fleet.Fleet`)."""

    def resolve(self, model: object, kind: str | None = None,
                route: str | None = None) -> list[Target]:
        """The backends a request naming ``model`` may go to, in configuration order.

        :raises RouteNotFound: no backend of ``kind`` serves ``route`` (404).
        :raises ModelNotFound: no backend serves ``model`` (404).
        """
        ...

    def usable(self, members: list[Target]) -> list[Target]:
        """The members new requests may go to now.

        :raises BackendNotReady: none is (503).
        """
        ...

    def queue_for(self, members: list[Target], on_route: RouteCounter | None = None
                  ) -> ModelQueue | None:
        """The one queue shared by ``members`` when there are several, else ``None``."""
        ...

    def mark_failed(self, backend: Target, queue: ModelQueue | None = None) -> float:
        """Mark ``backend`` down after a failure before any byte; seconds it is down."""
        ...


@runtime_checkable
class Planning(Protocol):
    """The parts of the gateway's state the pipeline reads: the settings, the clock, the
    backends (:class:`Backends`), the tenants, the metrics, whether the gateway is
    draining, and where a pool queue counts its routing decisions
    (:class:`gateway.fleet.state.GatewayState` has them all)."""

    @property
    def settings(self) -> Settings:
        """The configuration (``server``, ``admission``, ``routing``)."""
        ...

    @property
    def clock(self) -> Clock:
        """The injected time source."""
        ...

    @property
    def fleet(self) -> Backends:
        """The backends and their pool queues."""
        ...

    @property
    def tenants(self) -> Tenants:
        """Who is calling, and their place in the queues."""
        ...

    @property
    def metrics(self) -> GatewayMetrics:
        """The gateway's metrics."""
        ...

    @property
    def draining(self) -> bool:
        """The gateway is stopping: new requests are refused."""
        ...

    def count_route(self, model: str, backend: str, reason: str) -> None:
        """Count one routing decision of a pool queue (``gateway_route_decisions_total``)."""
        ...


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


def _ids_and_texts(prompt: str | tuple[int | str, ...]) -> tuple[int, list[str]]:
    """How many token ids a prompt has, and its texts."""
    if isinstance(prompt, str):
        return 0, [prompt]
    return (sum(1 for t in prompt if isinstance(t, int)),
            [t for t in prompt if isinstance(t, str)])


async def _estimate(req: ParsedRequest, margin: float) -> int:
    if req.spec.chat:
        text, messages = chat_text(req.body)
        counted = await estimate_tokens(text, messages=messages, margin=margin)
    elif not req.prompts:  # messages, responses, infill: the texts of the structure
        counted = await estimate_tokens("\n".join(req.texts), messages=max(
            1, len(req.body.get("messages") or [])), margin=margin)
    else:
        counts = []
        for prompt in req.prompts:
            ids, texts = _ids_and_texts(prompt)
            counts.append(ids + (await estimate_tokens("".join(texts), margin=margin)
                                 if texts else 0))
        counted = max(counts)
    return counted + req.extra_prompt_tokens


async def estimate_prompt(state: Planning, backend: Target, req: ParsedRequest
                          ) -> tuple[int, int]:
    """A local estimate of the prompt tokens, as (charged, raw): raw with no margin, and
    charged with the backend's factor for the model (the configured
    ``estimate_margin``, or a calibrated one; see :mod:`gateway.backends.ollama`)."""
    model = str(req.body.get("model") or "")
    factor = backend.dialect.estimate_factor(model, state.settings.admission.estimate_margin)
    return await _estimate(req, factor), await _estimate(req, 1.0)


async def count_prompt(state: Planning, backend: Target, req: ParsedRequest,
                       note: AccessRecord | None = None,
                       ) -> tuple[int, int | None, Callable[[], None] | None]:
    """Prompt tokens as the backend counts them (the longest prompt of a batch), else a
    local estimate; as (charged, raw estimate or ``None`` when counted exactly or when
    the prompt carries media (``ParsedRequest.media``), and for a single prompt counted
    exactly, how to drop its kept count should the backend's usage disagree with it).
    ``note`` (the request's :class:`~gateway.observe.record.AccessRecord`), if given,
    gets the count's source as ``count_source``, for the access line.

    A prompt the backend already counted (``backend.counts``, ``source="cache"`` when
    all were kept), or is counting now (``backend.counting``), is not sent again.

    :raises InvalidRequest: the backend refused the body as a client error (4xx).
    :raises UpstreamUnavailable: the backend cannot be reached (counted as ``connect``).
    """
    cached = 0  # prompts whose count was kept from an earlier request
    try:
        route = req.spec.counted_as
        if not req.prompts:  # chat, messages, responses, infill: the body as a whole
            queries = [(route, req.body)]
        else:  # completions, embeddings, rerank: each prompt, the longest charged
            model = {"model": req.body["model"]} if "model" in req.body else {}
            queries = [(route, {"prompt": list(p) if isinstance(p, tuple) else p, **model})
                       for p in req.prompts]
        counts: list[int | None] = []
        keys: list[bytes | None] = []
        for route, body in queries:
            key = backend.counts.key(route, body)
            keys.append(key)
            count = backend.counts.get(key)
            if count is None:
                count = await backend.counting.run(  # (asked again meanwhile: one call)
                    key, lambda: backend.count_prompt(route, body))  # noqa: B023
                if count is not None:
                    backend.counts.put(key, count)
            else:
                cached += 1
            counts.append(count)
        counted = None if None in counts else max(c for c in counts if c is not None)
    except BackendNotReady:
        raise
    except Exception as exc:
        kind = getattr(exc, "upstream_kind", None)
        if kind is UpstreamKind.connect:
            state.metrics.upstream_errors.labels(backend.name, kind).inc()
        raise
    raw = None
    if counted is None:
        counted, raw = await estimate_prompt(state, backend, req)
    source = "estimate" if raw is not None else "cache" if cached == len(queries) \
        else "backend"
    state.metrics.token_count_source.labels(backend.name, source).inc()
    if note is not None:
        note.count_source = source
    key = keys[0] if raw is None and len(keys) == 1 else None
    forget = None if key is None else partial(backend.counts.forget, key)
    # Media are charged a guess (a projector takes 256 to ~1,600 an image): the backend's
    # count of them neither calibrates the text estimate nor can show a truncation.
    return counted, None if req.media else raw, forget


def _prompt_floor(req: ParsedRequest) -> int:
    """Tokens the prompt has at least, from its size alone (no backend call)."""
    if req.texts:
        return tokens_at_least(["".join(req.texts)])
    if req.prompts:
        floors = []
        for prompt in req.prompts:
            ids, texts = _ids_and_texts(prompt)
            floors.append(ids + req.extra_prompt_tokens + (tokens_at_least(texts)
                                                           if texts else 0))
        return max(floors)
    texts = [t for message in req.body.get("messages") or [] for t in content_texts(message)]
    return tokens_at_least(["".join(texts)])


def _count_sdk_retry(state: Planning, request: Request) -> None:
    retry = request.headers.get("x-stainless-retry-count", "")
    if retry.isascii() and retry.isdigit():
        attempt = int(retry) if len(retry) < 4 else 999
        if attempt:
            state.metrics.client_retries.labels(str(attempt) if attempt < 10 else "10+").inc()


def require_ready(backend: Target) -> None:
    """Raise ``BackendNotReady`` (503) while the backend's capacity is not known."""
    if backend.admission.layout is None or not backend.ready:
        backend.discovery.request()
        why = backend.problem or "unreachable, loading, or its capacity is not known yet"
        raise BackendNotReady(
            f"Backend {backend.name!r} is not ready ({why}); retry after the Retry-After "
            "delay.",
            retry_after_s=1.0,
        )


async def prepare_exchange(state: Planning, request: Request, route: str) -> Exchange:
    """Run the pipeline for one request on ``route``: ``chat``, ``completions``,
    ``responses`` or ``embeddings`` (the OpenAI API), ``messages`` (Anthropic's),
    ``rerank``, ``infill`` or ``completion`` (llama-server's own), ``ollama_chat`` or
    ``ollama_generate`` (Ollama's native API).

    The request is counted once, on the first usable backend of its model, and planned
    against every usable backend of the model (:mod:`gateway.fleet.pool`): the exchange
    carries one :class:`~gateway.fleet.pool.Candidate` per backend it fits, and the
    :class:`~gateway.fleet.pool.AdmitPath` that admits it (the pool's queue, or a
    :class:`~gateway.fleet.pool.LoneBackend`).

    :raises GatewayError: the first step that refuses the request (4xx for the client's
        mistakes, 404 for a model no backend serves, 503 when no backend of the model is
        ready or its queue is full). When the request fits no backend, the refusal is
        the one from the backend with the largest slot.
    """
    started = state.clock.now()
    record = record_of(request.scope)
    record.route = route
    req = await _read_request(state, request, route)
    tenant = record.tenant or state.tenants.authenticate(request.headers.raw)
    party = _party(state, request, tenant, req.body, req.stream)
    backends, path, queue = _route(state, record, req, route, party)
    batch = max(1, len(req.prompts))
    refusals: list[tuple[int, GatewayError]] = []  # the largest slot's is raised
    fitting = _shape_fits(backends, req, route, batch, refusals)
    prompt_tokens, raw_estimate, forget_count, fitting = await _count_on_one(
        state, record, req, fitting, queue)
    candidates = _candidates(state, fitting, req, route, prompt_tokens, batch, refusals)
    first = candidates[0]
    prompt_total = prompt_tokens * batch  # a batch's prompts, each at most the longest
    hold, extra = await _charge_tenant(state, record, tenant, first, prompt_tokens,
                                       prompt_total)
    key, prefix = _affinity(state, req, queue)
    return Exchange(
        backend=first.backend, route=route, body=first.body, charge=first.charge,
        stream=req.stream, started=started, headers=list(request.headers.raw),
        admit_path=path, request_id=record.upstream_id or None,
        client_wants_usage=bool((req.body.get("stream_options") or {}).get(
            "include_usage")),
        extra_headers=extra, tag=first.tag, api=req.api,
        progress_s=_progress_s(state, request, req), raw_estimate=raw_estimate,
        forget_count=forget_count, tracked=first.tracked, candidates=candidates,
        queue=queue, affinity_key=key,
        affinity=queue.affinity_for(key) if queue is not None else None, prefix=prefix,
        tenant=tenant, party=party, hold=hold, prompt_total=prompt_total,
        batched=batch > 1, answer_model=_answer_model(state, req, first.backend),
        trace=record.trace,
    )


async def _read_request(state: Planning, request: Request, route: str) -> ParsedRequest:
    """Arrival: refuse while draining, count an SDK's retry, check the content type, read
    the body (at most ``server.max_body_bytes``) and parse it as ``route`` takes it.

    :raises ShuttingDown: the gateway is draining (503).
    :raises InvalidRequest: the content type or encoding, or the body (4xx).
    :raises PayloadTooLarge: the body is over the limit (413).
    """
    if state.draining:
        raise ShuttingDown("The gateway is shutting down; retry after the Retry-After "
                           "delay.", retry_after_s=1.0)
    _count_sdk_retry(state, request)
    check_content_type(request.headers.get("content-type"),
                       request.headers.get("content-encoding"))
    raw = await read_body(request, state.settings.server.max_body_bytes)
    return BY_NAME[route].parse(raw)


def _route(state: Planning, record: AccessRecord, req: ParsedRequest, route: str,
           party: Party) -> tuple[list[Target], AdmitPath, ModelQueue | None]:
    """Route: the usable backends of the request's model (the first, which counts it,
    checks the request), the :class:`~gateway.fleet.pool.AdmitPath` that admits it, and
    the pool's queue (``None`` for a lone backend). A full queue answers here, before
    any counting. ``record.backend`` names the backend the request is on so far.

    :raises GatewayError: as :meth:`Backends.resolve`, :meth:`Backends.usable` and the
        backend's ``check_request``; ``QueueFull`` (503) when it could only queue and
        the queue is full.
    """
    members = state.fleet.resolve(req.body.get("model"), req.spec.backend_kind, route=route)
    record.backend = members[0].name
    backends = state.fleet.usable(members)
    counter = backends[0]
    record.backend = counter.name
    counter.dialect.check_request(req)
    queue = state.fleet.queue_for(members, state.count_route)
    path: AdmitPath = queue if queue is not None else LoneBackend(
        counter, max_wait_s=state.settings.admission.max_queue_wait_s)
    path.check_room(party)
    return backends, path, queue


def _largest(refusals: list[tuple[int, GatewayError]]) -> GatewayError:
    """The refusal from the backend with the largest slot (the first of equals)."""
    return max(refusals, key=lambda r: r[0])[1]


def _shape_fits(backends: list[Target], req: ParsedRequest, route: str, batch: int,
                refusals: list[tuple[int, GatewayError]]) -> list[Target]:
    """Shape: the backends whose layout can hold what the body alone shows, before any
    counting; each refusal is added to ``refusals`` with the backend's slot size.

    :raises GatewayError: the largest slot's refusal, when no backend can hold it.
    """
    fitting = []
    for backend in backends:
        try:
            _check_shape(backend, req, route, batch)
            fitting.append(backend)
        except GatewayError as exc:
            refusals.append((_slot_of(backend), exc))
    if not fitting:
        raise _largest(refusals)
    return fitting


def _candidates(state: Planning, fitting: list[Target], req: ParsedRequest, route: str,
                prompt_tokens: int, batch: int, refusals: list[tuple[int, GatewayError]]
                ) -> list[Candidate]:
    """Candidates: the request planned on each of ``fitting`` it fits (:func:`_plan`),
    followed live only when every one of them can follow it (one response class for
    all); each refusal is added to ``refusals``.

    :raises GatewayError: the largest slot's refusal (of the shape's and these), when it
        fits no backend.
    """
    track = all(_trackable(backend, req, route, batch) for backend in fitting)
    candidates = []
    for backend in fitting:
        try:
            candidates.append(_plan(state, backend, req, route, prompt_tokens, batch,
                                    track))
        except GatewayError as exc:
            refusals.append((_slot_of(backend), exc))
    if not candidates:
        raise _largest(refusals)
    return candidates


async def _charge_tenant(state: Planning, record: AccessRecord, tenant: Tenant, first: Candidate,
                   prompt_tokens: int, prompt_total: int
                   ) -> tuple[TokenHold | None, list[tuple[bytes, bytes]]]:
    """Charge: note the counts in ``record``, hold ``prompt_total`` tokens of the tenant's
    tokens-per-minute quota, and the headers the answer gets (the prompt's count, the
    tenant's rate limits, a clamped cap), counting a defaulted or clamped cap.

    :raises QuotaExceeded: the tenant is over its quota (429).
    """
    charge = first.charge
    record.prompt_tokens, record.max_tokens = prompt_tokens, charge.max_tokens
    hold = await tenant.hold(state.clock.now(), prompt_total)  # 429 over the quota
    extra = [(b"x-gateway-prompt-tokens", str(prompt_tokens).encode())]
    extra += [(k.encode(), v.encode()) for k, v in
              tenant.rate_headers(state.clock.now()).items()]
    if charge.defaulted:
        state.metrics.default_max_tokens_applied.labels(first.backend.name).inc()
    if charge.clamped:
        state.metrics.max_tokens_clamped.labels(first.backend.name).inc()
        extra.append((b"x-gateway-max-tokens-clamped", str(charge.max_tokens).encode()))
    return hold, extra


def _affinity(state: Planning, req: ParsedRequest, queue: ModelQueue | None
              ) -> tuple[str | None, Prefix | None]:
    """With ``routing.affinity``: the conversation's key, for a pool to prefer the backend
    that served it (``None`` for a lone backend), and what its prompt holds, for slot
    affinity on a generation route."""
    affine = state.settings.routing.affinity
    key = affinity_key(req.body) if affine and queue is not None else None
    return key, prefix_of(req.body) if affine and req.spec.generates else None


def _progress_s(state: Planning, request: Request, req: ParsedRequest) -> float:
    """Seconds between queue progress comments: ``admission.queue_progress_s`` for a
    stream (not Ollama's) that asked with ``x-queue-progress``, else 0.0 (silent)."""
    asked = request.headers.get("x-queue-progress", "").strip().lower()
    return (state.settings.admission.queue_progress_s if req.stream
            and req.api != Api.ollama and asked in ("1", "true", "yes") else 0.0)


def _party(state: Planning, request: Request, tenant: Tenant, body: dict[str, Any],
           stream: bool) -> Party:
    """The request's place in the queues: its tenant and the class it asks for in the
    ``x-priority`` header or a string ``priority`` field (taken out of the body: the
    backend never sees it; an integer ``priority``, vLLM's own, is left as it is).

    Its TTFT deadline, if the request carries one (``x-gateway-slo-ttft-ms``,
    :mod:`gateway.wire.slo`), is carried on the party. A whole answer (``stream``
    false) carries no ITL target: no client sees its tokens' pace, so the SLO limit
    does not hold it (docs/latency.md).

    :raises InvalidRequest: the class named does not exist, or the deadline header is
        not a number of milliseconds.
    :raises Forbidden: it is above the tenant's class.
    """
    asked: object = request.headers.get(PRIORITY_HEADER)
    field_value = body.get("priority", 0)
    if field_value is None:
        del body["priority"]  # null: the tenant's own class
    elif isinstance(field_value, str):
        del body["priority"]
        asked = asked or field_value
    elif isinstance(field_value, bool) or not isinstance(field_value, int):
        raise InvalidRequest("priority must be a class name (a string) or, for vLLM's "
                             "own priority scheduling, an integer.", param="priority")
    party = state.tenants.party(tenant, asked.strip() if isinstance(asked, str) else asked)
    deadline = parse_ttft_deadline(request.scope["headers"])
    if deadline is not None:
        party = replace(party, ttft_deadline_s=deadline)
    record_of(request.scope).priority = party.priority
    if not stream and party.itl_target_s is not None:
        party = replace(party, itl_target_s=None)  # no ITL a client sees
    return party


async def _count_on_one(state: Planning, record: AccessRecord, req: ParsedRequest,
                        backends: list[Target], queue: ModelQueue | None
                        ) -> tuple[int, int | None, Callable[[], None] | None, list[Target]]:
    """Count the prompt on the first of ``backends`` that answers; one that cannot be
    reached, or is loading its model, is marked down and left out. Returns the count,
    the raw estimate and how to forget the count (see :func:`count_prompt`), and the
    backends still in play. ``record`` gets the backend counting and the count's source.

    :raises GatewayError: as :func:`count_prompt`, from the last backend tried.
    """
    routing = state.settings.routing
    for i, counter in enumerate(backends):
        record.backend = counter.name
        began = state.clock.now()
        try:
            counted, raw, forget = await count_prompt(state, counter, req, record)
            if record.trace is not None:
                record.trace.step("gateway.count", state.clock.now() - began, {
                    "gateway.backend": counter.name, "gateway.count.source":
                    record.count_source, "gateway.prompt_tokens": counted})
            return counted, raw, forget, backends[i:]
        except GatewayError as exc:
            passed_over = never_reached(exc) or isinstance(exc, BackendNotReady)
            if not (routing.failover and passed_over and i + 1 < len(backends)):
                raise
            state.fleet.mark_failed(counter, queue)
            state.metrics.failovers.labels(counter.model).inc()
    raise AssertionError("unreachable: the last backend's failure is raised")


def _slot_of(backend: Target) -> int:
    layout = backend.admission.layout
    return layout.usable_per_slot if layout is not None else 0


def _check_shape(backend: Target, req: ParsedRequest, route: str, batch: int) -> None:
    """Refuse, from the body alone, what ``backend``'s layout can never hold.

    :raises InvalidRequest: more completions than the backend has slots.
    :raises ContextLengthExceeded: the prompt is surely longer than a slot.
    """
    layout = backend.admission.layout
    assert layout is not None
    if req.queued_batch:  # the backend queues the items beyond its slots itself
        batch = min(batch, layout.slots)
    if req.n * batch > layout.slots:
        raise InvalidRequest(
            f"This request asks for {req.n * batch} completions (n × prompts), each of "
            f"which needs its own slot, but the backend has {layout.slots} slots.",
            param="n")
    floor = _prompt_floor(req)
    if floor > layout.usable_per_slot:
        raise ContextLengthExceeded(
            f"This prompt has at least {floor} tokens, more than a slot of "
            f"{layout.ctx_per_slot} tokens holds. Shorten the prompt.",
            param="prompt" if req.prompts else req.spec.prompt_field,
            n_prompt_tokens=floor, n_ctx=layout.ctx_per_slot,
        )


def _trackable(backend: Target, req: ParsedRequest, route: str, batch: int) -> bool:
    """Followed live (and so charged a prediction) under the predictive policy: one
    answer the backend can continue if it is preempted, or a whole one it can send
    again from the start (structured output)."""
    return (backend.predictive and route in backend.dialect.resumable_routes
            and req.n == 1 and batch == 1 and not req.queued_batch
            and route not in backend.dialect.unpinned_routes
            and req.spec.resumable and (resumable(route, req.body)
                                        or restartable(route, req.body, req.stream)))


def _plan(state: Planning, backend: Target, req: ParsedRequest, route: str,
          prompt_tokens: int, batch: int, tracked: bool) -> Candidate:
    """The charge and body of the request on ``backend``.

    :raises ContextLengthExceeded: it can never fit one of the backend's slots.
    """
    layout = backend.admission.layout
    assert layout is not None
    if req.queued_batch:
        batch = min(batch, layout.slots)
    admission = state.settings.admission
    default_cap = admission.default_max_tokens
    if default_cap is None:  # tracked: the room left in the slot, as the server gives
        default_cap = layout.usable_per_slot if tracked else STRICT_DEFAULT_MAX_TOKENS
    if route in backend.dialect.default_caps and "max_tokens" not in req.body:
        default_cap = min(default_cap, backend.dialect.default_caps[route])
    min_tokens = req.body.get("min_tokens")  # vLLM: a cap below it would be refused
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool):
        default_cap = max(default_cap, min_tokens)
    charge = replace(plan_charge(
        layout, prompt_tokens, req.max_tokens, n=req.n * batch,
        default_max_tokens=default_cap,
        policy=admission.overlong, cap_field=req.cap_field,
        prompt_field="prompt" if req.prompts else req.spec.prompt_field,
    ), pinnable=batch == 1 and not req.queued_batch
        and route not in backend.dialect.unpinned_routes,
        to_cap=req.body.get("ignore_eos") is True)
    if tracked:
        charge = replace(charge, predicted=backend.lengths.predict(
            charge.max_tokens, answer_shape(req.body)))
    body, tag = backend.prepare(req, charge)
    return Candidate(backend, charge, upstream_body(backend, body), tag, tracked)


def _answer_model(state: Planning, req: ParsedRequest, backend: Target) -> bytes | None:
    """What the ``model`` of the answers says (``routing.answer_model``): the name the
    client asked for (at most :data:`~gateway.wire.naming.ECHOED_NAME_MAX` characters:
    a longer one would be copied into every streamed event, a request of 100 KB making
    an answer of 100 MB), else the backend's model (a file path by its file name);
    ``None`` keeps the backend's own value."""
    if state.settings.routing.answer_model == "backend":
        return None
    asked = req.body.get("model")
    return answer_name(asked if isinstance(asked, str) and 0 < len(asked) <= ECHOED_NAME_MAX
                       else served_name(backend.model))
