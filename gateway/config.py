"""Typed settings, loaded once from a TOML file plus ``GATEWAY_*`` environment overrides.

This is the only module that reads files or the environment for configuration.
Everything else receives a :class:`Settings` instance.

Environment overrides use ``__`` between levels, for example
``GATEWAY_ADMISSION__MAX_QUEUE=8`` or ``GATEWAY_SERVER__PORT=9000``. The
``backends`` list can be replaced whole with JSON in ``GATEWAY_BACKENDS``.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

import tomli_w
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from gateway.core.capacity import CapPolicy

__all__ = [
    "AdmissionSettings",
    "BackendKind",
    "BackendSettings",
    "ClassSettings",
    "TenantSettings",
    "BACKEND_ARG_KEYS",
    "ConfigError",
    "AdmissionPolicy",
    "OverlongPolicy",
    "ServerSettings",
    "Settings",
    "StateBackend",
    "StateSettings",
    "backends_from_args",
    "load_settings",
    "open_files_needed",
    "redact_url",
    "settings_toml",
]


class ConfigError(Exception):
    """Raised when a configuration file or override is invalid.

    The message names every offending key (dotted path) and what is wrong with it.
    """


# What to do when prompt + requested max_tokens exceeds the slot: the capacity model's
# policy, used as the config type directly.
OverlongPolicy = CapPolicy

STRICT_DEFAULT_MAX_TOKENS = 1024  # default_max_tokens when unset, under "strict"


class AdmissionPolicy(StrEnum):
    """What a request is charged against the pool: its whole cap, or a prediction."""

    strict = "strict"
    predictive = "predictive"


class BackendKind(StrEnum):
    """The kind of server behind a backend entry (one module each in gateway/backends)."""

    llama_cpp = "llama.cpp"
    ollama = "ollama"
    vllm = "vllm"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# File descriptors behind server.max_connections = N: up to 2 x N client connections
# (each request in hand, and as many more idle, sending a head or being refused), one
# upstream connection per request in hand, and a reserve for the rest (the listening
# socket, the side-call pools, Redis, log files, the event loop's own).
_FDS_PER_CONNECTION = 3
_FDS_RESERVED = 256
# Above this many streams one process's single core is the bound, not its descriptors
# (49 KiB of RSS per open stream, docs/benchmarks.md): run workers instead.
_SIZED_MAX_CONNECTIONS_CAP = 10_000


def open_files_needed(max_connections: int) -> int:
    """The open-file limit a process serving ``max_connections`` requests at once needs:
    ``3 x max_connections + 256`` descriptors (see the comment above this function)."""
    return _FDS_PER_CONNECTION * max_connections + _FDS_RESERVED


def _sized_max_connections() -> int:
    """The default of ``server.max_connections``: as many as the process's hard limit on
    open files allows once each has its descriptors, ``(hard - 256) // 3``, at least 1 and
    at most 10,000 (also when the hard limit is unlimited)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return _SIZED_MAX_CONNECTIONS_CAP
    fit = (hard - _FDS_RESERVED) // _FDS_PER_CONNECTION
    return max(1, min(_SIZED_MAX_CONNECTIONS_CAP, fit))


class ServerSettings(_Strict):
    """Where the gateway listens and how much it will read from a client."""

    # One address, or several separated by commas as llama-server's --host takes them
    # ("127.0.0.1,::1"), each bound on the same port (gateway/http/serving.py).
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(10 * 1024 * 1024, gt=0)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    # Every log line, the gateway's and uvicorn's, as "text" (one line, the access line's
    # fields as key=value) or "json" (one object per line). gateway/observe/logs.py
    log_format: Literal["text", "json"] = "text"
    # One access line per request (logger gateway.access): what the gateway decided,
    # timings and token counts, never prompt or completion text nor keys. Probes,
    # /metrics and the status page are logged at DEBUG only.
    access_log: bool = True

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _lower_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value
    # How long an idle client connection is kept open, seconds (announced in a
    # "Keep-Alive: timeout=N" header): above the 60-90 s that client pools keep theirs.
    keepalive_timeout_s: int = Field(120, ge=1)
    # On SIGTERM/SIGINT: /ready turns 503 and new requests get 503 shutting_down at once;
    # requests in flight (and queued ones, with drain_queued = "serve") get this long
    # to finish before the server stops (seconds). A second signal stops at once.
    drain_timeout_s: float = Field(30.0, ge=0)
    drain_queued: Literal["serve", "refuse"] = "serve"
    # Client connection limits (gateway/http/connection.py): the longest a client may take to
    # send a request head, from its first byte (slowloris); the longest it may pause
    # while sending a body (seconds); and how many requests a process has in hand at
    # once, each on its own client connection (max_connections). Past it a new request
    # gets 503 too_many_connections in its API's shape, with Retry-After, counted in
    # gateway_rejections_total; those within it are served. Client connections open at
    # once are capped at twice it (one past that is closed unanswered). A bound on
    # sockets and file descriptors, far above max_queue on purpose. Per process: with
    # `gateway serve --workers N` each worker has its own, N times it in all. Unset, it
    # is sized from the hard limit on open files (RLIMIT_NOFILE): (hard - 256) // 3, at
    # most 10,000 (see open_files_needed); `gateway serve` raises the soft limit to match.
    head_timeout_s: float = Field(10.0, gt=0)
    body_idle_timeout_s: float = Field(30.0, gt=0)
    max_connections: int = Field(default_factory=_sized_max_connections, ge=1)
    # The bearer key of the /admin routes (backends view, drain, reload) and of /metrics;
    # unset: the admin routes do not exist and /metrics is open.
    admin_key: SecretStr | None = None

    @field_validator("admin_key")
    @classmethod
    def _admin_key_not_blank(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("must not be empty (leave it unset to have no admin routes)")
        return value

    # With admin_key set, /metrics still answers without it (a Prometheus on a private
    # network scraping without credentials).
    metrics_public: bool = False
    # CORS for browser clients, as llama-server answers it (gateway/http/middleware.py,
    # CorsOnApi): the origins allowed ("*": any, each echoed back with credentials
    # allowed, llama-server's default); empty, the default: no CORS headers, no preflight.
    # Never on the status page or /admin.
    cors_origins: list[str] = Field(default_factory=list)
    # llama-server's GET/POST /tools (its built-in tools and MCP servers, started with
    # --tools or --mcp-config): a call runs a tool on the backend's machine for whoever
    # sends it, so the gateway relays it only when this is true (else 403 not_relayed).
    relay_tools: bool = False

    @field_validator("host")
    @classmethod
    def _hosts_not_blank(cls, value: str) -> str:
        if any(not part.strip().strip("[]") for part in value.split(",")):
            raise ValueError("an address must not be empty (several are separated by commas)")
        return value

    @field_validator("cors_origins")
    @classmethod
    def _origins_not_blank(cls, value: list[str]) -> list[str]:
        if any(not o.strip() for o in value):
            raise ValueError("an origin must not be empty (\"*\" allows any)")
        return value


class AdmissionSettings(_Strict):
    """Queueing and output-cap policy, shared by every backend."""

    max_queue: int = Field(64, ge=0)
    max_queue_wait_s: float = Field(30.0, gt=0)
    # Refuse at once (503 queue_wait_too_long, Retry-After from the prediction) a request
    # whose predicted wait (a replay of the queue ahead with the recent served durations)
    # is longer than max_queue_wait_s, instead of letting it wait that long for a 503.
    reject_predicted_timeouts: bool = True
    # A queued stream whose request carries "X-Queue-Progress: 1" gets its 200 and an
    # SSE comment (": queued position=N eta_s=M") every this many seconds while it
    # waits; 0 turns the feature off.
    queue_progress_s: float = Field(0.0, ge=0.0)
    # Output cap for a request that sets none. Unset: 1024 under "strict"; under
    # "predictive", the room left in the slot, as llama-server and vLLM themselves give.
    default_max_tokens: int | None = Field(None, ge=1)
    # "strict" charges prompt + the whole output cap. "predictive" charges prompt + a
    # predicted completion length (the predict_quantile of the lengths recently served,
    # at most the cap), follows each request's real use as its tokens arrive, and
    # preempts and resumes requests before the pool would overflow (llama.cpp backends
    # with a unified KV pool; elsewhere it charges as "strict").
    policy: AdmissionPolicy = AdmissionPolicy.strict
    predict_quantile: float = Field(0.95, gt=0.0, le=1.0)
    # Served answers seen on a backend before predicting; until then the cap is charged.
    predict_min_history: int = Field(16, ge=1)
    # Tokens of a unified pool kept free under "predictive": preemption starts when live
    # use plus the growth possible in the next quarter second would pass pool - margin.
    preempt_margin_tokens: int = Field(32, ge=0)
    overlong: OverlongPolicy = OverlongPolicy.reject
    # Multiplier applied to the local tiktoken estimate when the backend cannot count.
    estimate_margin: float = Field(1.25, ge=1.0)
    # Exact prompt counts kept per backend (gateway/backends/countcache.py), so that a prompt the
    # backend already counted is not sent to be counted again; 0 turns this off.
    count_cache_entries: int = Field(4096, ge=0)
    # How long a reservation outlives an upstream request the gateway abandoned when the
    # backend cannot show its slots (llama-server --no-slots): then llama-server notices
    # the closed connection only when it next writes or polls. With /slots (the default)
    # the reservation is held until the request's slot is seen free instead.
    disconnect_grace_s: float = Field(2.0, ge=0.0)
    # Longest hold of an abandoned request that /slots does not show ending (seconds): it
    # may still be queued inside a busy backend, or may never have reached it. Released
    # sooner once every slot has been seen idle.
    abandon_confirm_timeout_s: float = Field(120.0, gt=0.0)
    # Prefill deferral (docs/latency.md): while streams of a class with itl_p95_s decode
    # on a backend, a request whose prefill is predicted to take longer than their
    # target is held back for at most this many seconds since it came (never past its
    # TTFT deadline), or until they end; 0 turns it off. Without an ITL target in flight,
    # nothing is held.
    prefill_defer_s: float = Field(2.0, ge=0.0, allow_inf_nan=False)
    # Priority ageing (gateway/core/fairness.py): a waiting request competes one class higher
    # for every this many seconds it has waited, so that lower classes are never starved.
    priority_age_s: float = Field(30.0, gt=0.0)


class BackendSettings(_Strict):
    """One upstream server and what is known of its KV layout.

    Omitted ``slots``/``ctx_per_slot`` are discovered where the kind shows them
    (llama-server ``/props``; Ollama ``/api/ps``; vLLM ``/v1/models`` ``max_model_len``).
    ``kv_unified`` and ``pool_tokens`` of llama-server cannot be discovered over HTTP
    (``shared/design/backends.md`` §4.7), so they come from here; vLLM shows its pool in
    ``/metrics``. Ollama's and vLLM's ``slots`` (``OLLAMA_NUM_PARALLEL``,
    ``--max-num-seqs``) are shown nowhere and default to the server's own default.
    """

    name: str = Field(min_length=1)
    url: str = "http://127.0.0.1:8080"
    kind: BackendKind = BackendKind.llama_cpp
    # The model clients name to reach this backend; several backends with one model form
    # a pool the gateway routes across (gateway/fleet/pool.py). Unset: the id the backend
    # reports in /v1/models. Aliases are further names of the same model.
    model: str | None = Field(None, min_length=1)
    aliases: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    slots: int | None = Field(None, ge=1)
    ctx_per_slot: int | None = Field(None, ge=2)
    # llama.cpp only (Ollama's slots are always private, vLLM's pool always shared):
    # unset means true, the safe choice.
    kv_unified: bool | None = None
    pool_tokens: int | None = Field(None, ge=2)
    connect_timeout_s: float = Field(5.0, gt=0)
    # Longest silence allowed while reading the upstream response (prefill included).
    read_timeout_s: float = Field(600.0, gt=0)
    discovery_interval_s: float = Field(30.0, gt=0)
    # At the first discovery, two short completions of the gateway's own (16 tokens;
    # llama-server only) whose timings give the decode pace, so that a fresh gateway
    # predicts queue waits (and refuses doomed requests) before any answer has ended.
    calibrate: bool = True
    # At the first discovery, a few requests that generate nothing (llama-server only:
    # gateway.wire.builds), to say once what this build lacks and what the gateway does
    # instead, or to refuse a build it cannot count prompts on.
    survey: bool = True
    # Idle pooled connections to the backend are closed after this, seconds: below the
    # backend's own keep-alive timeout (llama-server: 5 s), so the gateway never writes a
    # request onto a connection the backend is closing.
    keepalive_expiry_s: float = Field(2.0, gt=0)
    # The key the server was started with (--api-key), sent as "Authorization: Bearer"
    # on every upstream call; or a file holding it (read once, at load).
    api_key: SecretStr | None = None
    api_key_file: Path | None = None

    @field_validator("url")
    @classmethod
    def _url_scheme(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {value!r}")
        value = value.rstrip("/")
        parts = urlsplit(value)
        try:
            parts.port  # noqa: B018 - raises on a port that is not one
        except ValueError:
            raise ValueError(f"has no valid port (1-65535): {value!r}") from None
        if not parts.hostname:
            raise ValueError(f"names no host: {value!r}")
        if parts.query or parts.fragment or "?" in value or "#" in value:
            raise ValueError(f"is the server's base URL, without a query or fragment (each "
                             f"route's path is added to it): {value!r}")
        if value.endswith("/v1"):
            raise ValueError(f"is the server's base URL, without /v1 (the gateway adds each "
                             f"route's path): {value[:-3]!r}, not {value!r}")
        return value

    @model_validator(mode="after")
    def _key_from_file(self) -> BackendSettings:
        if self.api_key_file is None:
            return self
        if self.api_key is not None:
            raise ValueError("set api_key or api_key_file, not both")
        try:
            key = self.api_key_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"api_key_file {str(self.api_key_file)!r} cannot be read: "
                             f"{exc.strerror or exc}") from None
        if not key:
            raise ValueError(f"api_key_file {str(self.api_key_file)!r} is empty")
        object.__setattr__(self, "api_key", SecretStr(key))
        return self

    @property
    def auth_headers(self) -> dict[str, str]:
        """``Authorization: Bearer KEY`` when a key is configured, else nothing."""
        if self.api_key is None:
            return {}
        return {"Authorization": f"Bearer {self.api_key.get_secret_value()}"}

    @property
    def unified(self) -> bool:
        """``kv_unified``, where it applies: true unless set false (llama.cpp)."""
        return self.kv_unified is not False

    @model_validator(mode="after")
    def _pool_vs_slot(self) -> BackendSettings:
        real = {BackendKind.ollama: False, BackendKind.vllm: True}.get(self.kind)
        if self.kv_unified is not None and real is not None and self.kv_unified != real:
            raise ValueError(f"kv_unified = {str(self.kv_unified).lower()} contradicts a "
                             f"{self.kind.value} backend, whose slots "
                             f"{'share one pool' if real else 'each have their own context'}"
                             "; kv_unified applies to kind 'llama.cpp' (remove the key)")
        if self.pool_tokens is not None and self.kind is BackendKind.ollama:
            raise ValueError("pool_tokens does not apply to an ollama backend: each slot has "
                             "its own context")
        if self.pool_tokens is not None and self.kv_unified is False:
            raise ValueError("pool_tokens only applies when kv_unified = true")
        if self.pool_tokens is not None and self.ctx_per_slot is not None:
            if self.pool_tokens < self.ctx_per_slot:
                raise ValueError(
                    f"pool_tokens ({self.pool_tokens}) is smaller than ctx_per_slot "
                    f"({self.ctx_per_slot}); a unified pool holds at least one slot's context"
                )
        return self


class ClassSettings(_Strict):
    """One priority class (``[[classes]]``, listed highest first)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    # The longest a request of this class waits in the queue, seconds; unset:
    # admission.max_queue_wait_s. A batch class can wait far longer than an interactive one.
    max_queue_wait_s: float | None = Field(None, gt=0)
    # Latency targets of this class, seconds (docs/latency.md): the 95th percentile of
    # time to first token and of inter-token latency its requests should see. Unset: no
    # target, the class is admitted as far as memory allows (as without them).
    ttft_p95_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    itl_p95_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    # A request predicted to get its first token after its deadline (its
    # x-gateway-slo-ttft-ms header, else ttft_p95_s): "refuse" answers 503
    # slo_unattainable with Retry-After at once; "serve" queues it anyway.
    late: Literal["refuse", "serve"] = "refuse"


_HEX = frozenset("0123456789abcdef")


def _key_hash(value: str, where: str) -> str:
    """A SHA-256 key hash as 64 lowercase hex digits (an optional ``sha256:`` prefix is
    dropped).

    :raises ValueError: it is not one.
    """
    text = value.strip().lower()
    text = text.removeprefix("sha256:")
    if len(text) != 64 or not set(text) <= _HEX:
        raise ValueError(f"{where}: an entry is not a SHA-256 hash of a key (64 hex digits, "
                         "as `gateway hash-key` prints); plain keys are not stored")
    return text


class TenantSettings(_Strict):
    """One tenant (``[[tenants]]``): who it is, its keys, its class and its quotas.

    Keys are stored only as SHA-256 hashes (``gateway hash-key`` prints one), listed in
    ``key_hashes``, or in the environment variable ``key_hashes_env`` names, or in the file
    ``key_hashes_file`` names (separated by commas, spaces or lines; ``#`` starts a
    comment in the file). All three may be combined; each is read once, at load.
    """

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    key_hashes: list[str] = Field(default_factory=list)
    key_hashes_env: str | None = Field(None, min_length=1)
    key_hashes_file: Path | None = None
    # The class of its requests (a [[classes]] name; unset: the first class). A request
    # may ask for a lower class, never a higher one.
    priority: str | None = Field(None, min_length=1)
    # Its share when several tenants wait: KV tokens served are divided by the weight.
    weight: float = Field(1.0, gt=0)
    # Most of its requests past its gate at once (waiting for capacity or in flight).
    max_inflight: int | None = Field(None, ge=1)
    # Most of its requests waiting at once (at its gate or for capacity).
    max_queued: int | None = Field(None, ge=0)
    # Prompt + completion tokens per rolling minute, as the gateway counts them.
    tokens_per_minute: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _gather_keys(self) -> TenantSettings:
        hashes = [_key_hash(h, "key_hashes") for h in self.key_hashes]
        if self.key_hashes_env is not None:
            raw = os.environ.get(self.key_hashes_env)
            if raw is None:
                raise ValueError(f"key_hashes_env: the environment variable "
                                 f"{self.key_hashes_env!r} is not set")
            hashes += [_key_hash(h, f"${self.key_hashes_env}")
                       for h in raw.replace(",", " ").split()]
        if self.key_hashes_file is not None:
            try:
                text = self.key_hashes_file.read_text(encoding="utf-8")
            except OSError as exc:
                raise ValueError(f"key_hashes_file {str(self.key_hashes_file)!r} cannot be "
                                 f"read: {exc.strerror or exc}") from None
            lines = (line.split("#", 1)[0] for line in text.splitlines())
            hashes += [_key_hash(h, str(self.key_hashes_file))
                       for line in lines for h in line.replace(",", " ").split()]
        if not hashes:
            raise ValueError(f"tenant {self.name!r} has no key: give key_hashes, "
                             "key_hashes_env or key_hashes_file")
        object.__setattr__(self, "key_hashes", list(dict.fromkeys(hashes)))
        return self


class RoutingSettings(_Strict):
    """How requests find a backend when several are configured (gateway/fleet/pool.py)."""

    # The model used for requests that name none, or one no backend serves. Unset: such
    # requests go to the only model when all backends serve one, else get 404.
    default_model: str | None = Field(None, min_length=1)
    # Requests that share a conversation prefix go to the backend that served it last
    # (its slots keep the prompt cache), while it has room.
    affinity: bool = True
    # A request whose backend fails before any byte reached the client (connection
    # refused or timed out, or a 5xx answer) is sent to another backend of its model.
    failover: bool = True
    # A failed backend is skipped for this long, doubled on each further failure up to
    # down_max_s, then tried by one request again (half-open), seconds.
    down_initial_s: float = Field(1.0, gt=0)
    down_max_s: float = Field(30.0, gt=0)
    # What the "model" of every answer (whole and streamed) says: "served", the name the
    # client asked for, else the backend's model (a file path by its file name);
    # "backend", the backend's own value (llama-server: its model file's path).
    answer_model: Literal["served", "backend"] = "served"


class StateBackend(StrEnum):
    """Where admission state lives (``[state] backend``)."""

    memory = "memory"  # in this process only: one gateway process per backend
    redis = "redis"  # in Redis, shared by every gateway process of the same key_prefix


class StateSettings(_Strict):
    """Admission state shared by several gateway processes (gateway/admission/shared.py).

    With ``backend = "redis"``, every process using the same ``redis_url`` and
    ``key_prefix`` reserves against one budget per backend: reserved tokens, busy slots
    and which slot each lease holds, and the queue's order of arrival.
    """

    backend: StateBackend = StateBackend.memory
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Keys and channels start with this, so several gateways (each with its own backends)
    # can share one Redis. Processes in front of the same backends must share it.
    key_prefix: str = Field("llm-gateway", min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
    # A process renews its liveness this often, seconds; its leases and queued requests
    # are dropped by the others once it has not renewed for lease_ttl_s.
    renew_interval_s: float = Field(1.0, gt=0)
    lease_ttl_s: float = Field(10.0, gt=0)
    # Longest wait for one Redis call, seconds; past it the request gets 503
    # state_unavailable.
    op_timeout_s: float = Field(1.0, gt=0)
    # With Redis unreachable: "refuse" answers 503 state_unavailable; "local" admits
    # against 1/N of each backend, N the most processes seen alive (or `replicas`, when
    # larger). The risk of "local": more processes than N (one started during the
    # outage) overflow the backend.
    on_unavailable: Literal["refuse", "local"] = "refuse"
    replicas: int = Field(0, ge=0)
    # A waiting request looks at the shared queue again at least this often, seconds,
    # even when no notification came (notifications are pub/sub, which may drop one).
    poll_interval_s: float = Field(0.5, gt=0)
    # Under admission.policy = "predictive", each process publishes its leases' live
    # figures (tokens used, decode rate, progress) this often, seconds, while they change;
    # what a reader may not see of a stream is its decode rate x (0.25 s + this).
    live_interval_s: float = Field(0.1, ge=0.01)

    @model_validator(mode="after")
    def _live_interval_short(self) -> StateSettings:
        if self.live_interval_s > self.renew_interval_s:
            raise ValueError(
                f"live_interval_s ({self.live_interval_s:g}) must be at most "
                f"renew_interval_s ({self.renew_interval_s:g}): the live figures are "
                "republished every renewal anyway, and between publishes the others "
                "project a stream's growth over this interval")
        return self

    @model_validator(mode="after")
    def _ttl_long(self) -> StateSettings:
        if self.lease_ttl_s < 3 * self.renew_interval_s:
            raise ValueError(
                f"lease_ttl_s ({self.lease_ttl_s:g}) must be at least 3 x "
                f"renew_interval_s ({self.renew_interval_s:g}): a live process that "
                "misses one renewal must not lose its leases")
        if self.backend is not StateBackend.redis:
            return self
        shown = redact_url(self.redis_url)
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix:// "
                             f"(got {shown!r})")
        from redis.connection import parse_url  # the reading the client will make

        try:
            parse_url(self.redis_url)
        except ValueError as exc:  # its messages name the part, never the password
            raise ValueError(f"redis_url {shown!r} cannot be read: {exc}") from None
        return self


def redact_url(url: str) -> str:
    """``url`` with its password shown as ``***``: the userinfo's (``redis://user:PW@``,
    ``redis://:PW@``) and a ``password=`` query argument (which redis-py also reads), so a
    URL can be printed or logged. Anything that cannot be split is shown as ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "***"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{host}" if colon else f"***@{host}"
    query = "&".join(
        f"{k}=***" if k.lower() == "password" else f"{k}={v}" if sep else k
        for k, sep, v in (pair.partition("=") for pair in parts.query.split("&") if pair))
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _require_unique(what: str, names: list[str]) -> None:
    """:raises ValueError: a name is repeated (the message lists every one)."""
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{what} names must be unique; repeated: {', '.join(dupes)}")


class Settings(BaseSettings):
    """The whole gateway configuration. Frozen; build it with :func:`load_settings`."""

    model_config = SettingsConfigDict(
        env_prefix="GATEWAY_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    server: ServerSettings = ServerSettings()
    admission: AdmissionSettings = AdmissionSettings()
    routing: RoutingSettings = RoutingSettings()
    state: StateSettings = StateSettings()
    backends: list[BackendSettings] = Field(
        default_factory=lambda: [BackendSettings(name="local")], min_length=1
    )
    # Priority classes, highest first (gateway/core/fairness.py); unset: one class, "default".
    classes: list[ClassSettings] = Field(
        default_factory=lambda: [ClassSettings(name="default")], min_length=1)
    # Who may use the gateway (gateway/admission/tenants.py); none: it is open to anyone.
    tenants: list[TenantSettings] = Field(default_factory=list)

    @field_validator("classes")
    @classmethod
    def _unique_classes(cls, value: list[ClassSettings]) -> list[ClassSettings]:
        _require_unique("class", [c.name for c in value])
        return value

    @model_validator(mode="after")
    def _tenants_consistent(self) -> Settings:
        classes = [c.name for c in self.classes]
        owners: dict[str, str] = {}
        _require_unique("tenant", [t.name for t in self.tenants])
        for tenant in self.tenants:
            if tenant.priority is not None and tenant.priority not in classes:
                raise ValueError(f"tenant {tenant.name!r}: priority {tenant.priority!r} is "
                                 f"not a class ({', '.join(classes)})")
            for digest in tenant.key_hashes:
                other = owners.setdefault(digest, tenant.name)
                if other != tenant.name:
                    raise ValueError(f"tenants {other!r} and {tenant.name!r} share a key "
                                     f"(hash {digest[:12]}...); each key names one tenant")
        return self

    @field_validator("backends")
    @classmethod
    def _unique_names(cls, value: list[BackendSettings]) -> list[BackendSettings]:
        names = [b.name for b in value]
        _require_unique("backend", names)
        servers: dict[str, str] = {}  # url -> backend, for kinds serving one model
        for backend in value:
            if backend.kind is BackendKind.ollama:
                continue  # one Ollama serves many models, each with its own slots
            other = servers.setdefault(backend.url, backend.name)
            if other != backend.name:
                raise ValueError(f"backends {other!r} and {backend.name!r} share the url "
                                 f"{redact_url(backend.url)}: each would count that "
                                 "server's whole KV pool as its own; list it once")
        owner: dict[str, str] = {}  # model name or alias -> the model it stands for
        for backend in value:
            if backend.model is None:
                if backend.aliases:
                    raise ValueError(f"backend {backend.name!r}: aliases need a model")
                continue
            for alias in (backend.model, *backend.aliases):
                if alias in names and alias != backend.name:
                    raise ValueError(f"{alias!r} names both a backend and a model of "
                                     f"backend {backend.name!r}; rename one")
                seen = owner.setdefault(alias, backend.model)
                if seen != backend.model:
                    raise ValueError(f"{alias!r} stands for two models, {seen!r} and "
                                     f"{backend.model!r}")
        return value

    @model_validator(mode="after")
    def _shared_state_supported(self) -> Settings:
        if self.state.backend is not StateBackend.redis:
            return self
        # admission.policy = "predictive" is shared too: each process publishes its
        # leases' live figures (gateway.admission.shared_live); a pool waits in its
        # backends' shared queues (gateway.fleet.shared_pool).
        return self

    @model_validator(mode="after")
    def _default_model_known(self) -> Settings:
        default = self.routing.default_model
        if default is None or any(b.model is None for b in self.backends):
            return self  # a discovered model id may match it
        known = {n for b in self.backends for n in (b.name, b.model, *b.aliases) if n}
        if default not in known:
            raise ValueError(f"routing.default_model {default!r} is not a model, alias or "
                             f"backend name configured ({', '.join(sorted(known))})")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment wins over the values passed in (which come from the TOML file).
        return (env_settings, init_settings)


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        err["msg"] = err["msg"].removeprefix("Value error, ")  # our validators' own words
        if err["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key")
        elif (key.startswith("tenants") or "key" in key
              or isinstance(err.get("input"), (dict, list))):
            # never echo what may be a secret: a key, or a section that holds one
            lines.append(f"{key}: {err['msg']}")
        else:
            got = f" (got {err.get('input')!r})" if "got " not in err["msg"] else ""
            lines.append(f"{key}: {err['msg']}{got}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def load_settings(path: str | Path | None = None, **overrides: Any) -> Settings:
    """Load settings from a TOML file (optional), then apply ``GATEWAY_*`` env overrides.

    :param path: TOML file path; ``None`` means defaults plus environment only.
    :param overrides: top-level sections given directly (tests use this).
    :raises ConfigError: the file is missing or not TOML, or a key is unknown or invalid.
        The message names each offending key.
    """
    data: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file not found: {file}")
        try:
            data = TomlConfigSettingsSource(Settings, toml_file=file)()
        except Exception as exc:  # tomllib raises TOMLDecodeError (a ValueError)
            raise ConfigError(f"config file {file} is not valid TOML: {exc}") from exc
    data.update(overrides)
    _check_env_sections()
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def _check_env_sections() -> None:
    """Refuse a ``GATEWAY_SECTION__KEY`` override whose section is not one of the
    settings' (pydantic-settings would ignore it silently, where an unknown key in a
    known section is refused). Variables without ``__`` are not settings' overrides but
    for ``GATEWAY_BACKENDS``, ``GATEWAY_CLASSES``, ... (``GATEWAY_MODEL`` is
    ``make run``'s model file).

    :raises ConfigError: naming the variable and the sections there are.
    """
    for name in os.environ:
        upper = name.upper()
        if not upper.startswith("GATEWAY_") or "__" not in upper:
            continue
        section = upper.removeprefix("GATEWAY_").split("__", 1)[0].lower()
        if section not in Settings.model_fields:
            raise ConfigError(f"{name}: unknown section {section!r} (the sections are "
                              f"{', '.join(Settings.model_fields)})")


# -- backends from the command line (gateway serve --backend URL) -------------------------

#: The keys a ``--backend`` argument may give, besides its URL: those of a ``[[backends]]``
#: entry that take one value. ``api_key`` is not one: a key on a command line is seen by
#: anyone who can list processes, and stays in the shell's history (``api_key_file``).
BACKEND_ARG_KEYS = ("name", "kind", "url", "model", "api_key_file", "slots", "ctx_per_slot",
                    "kv_unified", "pool_tokens")


def _backend_arg(text: str) -> dict[str, str]:
    """One ``--backend`` argument as the ``[[backends]]`` keys it gives.

    :raises ConfigError: an item is neither a URL nor ``key=value``, a key is unknown or
        given twice, or there is no URL.
    """
    entry: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, value = ("url", item) if item.startswith(("http://", "https://")) \
            else item.partition("=")[::2]
        if key == item or not value:
            raise ConfigError(f"--backend {text!r}: {item!r} is neither the server's URL "
                              "(http://HOST:PORT or https://...) nor key=value")
        key = key.strip()
        if key == "api_key":
            raise ConfigError(f"--backend {text!r}: give api_key_file=PATH, not the key "
                              "itself (a command line is visible to every user of the machine)")
        if key not in BACKEND_ARG_KEYS:
            raise ConfigError(f"--backend {text!r}: unknown key {key!r} (one of "
                              f"{', '.join(BACKEND_ARG_KEYS)})")
        if key in entry:
            raise ConfigError(f"--backend {text!r}: {key} is given twice")
        entry[key] = value.strip()
    if "url" not in entry:
        raise ConfigError(f"--backend {text!r}: no URL (for example "
                          "--backend http://127.0.0.1:8080)")
    kinds = [k.value for k in BackendKind]
    if "kind" in entry and entry["kind"] not in kinds:
        raise ConfigError(f"--backend {text!r}: unknown kind {entry['kind']!r} (one of "
                          f"{', '.join(kinds)}; leave it out to have it detected)")
    return entry


def backends_from_args(args: Sequence[str]) -> list[dict[str, str]]:
    """The ``[[backends]]`` entries that ``--backend`` arguments stand for, in order.

    Each argument is the server's URL with optional ``key=value`` items, separated by
    commas, in any order: ``http://127.0.0.1:8080``, ``http://h:11434,kind=ollama``,
    ``name=big,kind=vllm,url=http://h:8000``. Keys are those of
    :data:`BACKEND_ARG_KEYS`. An entry without ``name`` is named by its URL's host and
    port (``127.0.0.1:8080``; ``-2``, ``-3`` added to a repeated one). An entry without
    ``kind`` keeps none: the caller detects it (``gateway serve`` asks the server,
    :func:`gateway.planner.probe.probe`). Each entry is checked as a ``[[backends]]``
    entry would be.

    :raises ConfigError: an argument cannot be read (:func:`_backend_arg`), an entry is
        not a valid backend (the message names the argument and the key), or
        ``GATEWAY_BACKENDS`` lists the backends too.
    """
    if os.environ.get("GATEWAY_BACKENDS"):
        raise ConfigError("--backend and GATEWAY_BACKENDS both list the backends; give "
                          "one of them")
    entries: list[dict[str, str]] = []
    names: set[str] = set()
    for text in args:
        entry = _backend_arg(text)
        if "name" not in entry:
            base = urlsplit(entry["url"]).netloc.rsplit("@", 1)[-1] or "backend"
            name, n = base, 1
            while name in names:
                n += 1
                name = f"{base}-{n}"
            entry = {"name": name, **entry}
        names.add(entry["name"])
        try:
            BackendSettings(**entry)  # the kind, when not given, is checked at load
        except ValidationError as exc:
            raise ConfigError(f"--backend {text!r}: "
                              + _describe(exc).split(":\n  ", 1)[1]) from None
        entries.append(entry)
    return entries


def settings_toml(settings: Settings) -> tuple[str, list[str]]:
    """The TOML file that amounts to ``settings``: every key that was given (in a file,
    the environment or on the command line), defaults left out, written by ``tomli_w``.

    Secrets are left out, each with a note: ``server.admin_key`` and an inline
    ``backends[].api_key`` (one read from ``api_key_file`` is not printed; the file's
    name is); a password in ``state.redis_url`` or a ``backends[].url``
    (``http://user:PW@host``, sent as HTTP Basic) is shown as ``***``.

    :returns: the TOML text, and the notes (one line each) on what it leaves out.
    """
    data = settings.model_dump(mode="json", exclude_unset=True, exclude_none=True)
    notes = []
    if "admin_key" in data.get("server", {}):
        del data["server"]["admin_key"]
        notes.append("server.admin_key is set and not printed: add it back")
    for i, backend in enumerate(data.get("backends", [])):
        if backend.pop("api_key", None) is not None:
            notes.append(f"backends[{i}].api_key is set and not printed: add it back, or "
                         "give api_key_file")
        if "url" in backend and (shown := redact_url(backend["url"])) != backend["url"]:
            backend["url"] = shown
            notes.append(f"backends[{i}].url holds a password, printed as ***: add it back")
    if "redis_url" in data.get("state", {}):
        shown = redact_url(settings.state.redis_url)
        if shown != settings.state.redis_url:
            notes.append("state.redis_url holds a password, printed as ***: add it back")
        data["state"]["redis_url"] = shown
    return tomli_w.dumps(data), notes
