"""llama-server in router mode: one server, many models, one admission target each.

Started without ``-m`` (``--models-dir``, ``--models-preset`` or its cache), llama-server
is a router (``tools/server/server.cpp``, ``is_router_server``): ``GET /props`` answers
``{"role": "router", "max_instances": N, "models_autoload": true, ...}``
(``get_router_props``, ``tools/server/server-models.cpp``); ``GET /models`` lists each
model with ``status.value`` (``unloaded``, ``loading``, ``loaded``, ``sleeping``; a load
that failed is ``unloaded`` with ``status.failed`` and ``status.exit_code``) and
``status.args``, the command line its child process is (or was) started with
(``get_router_models``). Each model runs in a child llama-server of its own, with its own
slots and KV pool; the router forwards a POST by its body's ``model`` and a GET by
``?model=`` (``proxy_post``, ``proxy_get``), loading the model first unless
``autoload=false`` is in the query or the router runs ``--no-models-autoload``
(``is_autoload``, ``router_validate_model``). See ``docs/router.md``.

The configured ``[[backends]]`` entry stays the router's *hub* (its ``target.router``, a
:class:`~gateway.backends.base.RouterRole`, holds the :class:`RouterHub`); the fleet
(:mod:`gateway.fleet.routers`) makes it one when its discovery answers
:class:`~gateway.backends.base.ManyModels`, and gives each listed model a *member*
target named ``<hub>/<model id>`` that serves that model, whose dialect is
:class:`RouterModel`: llama-server's
dialect with the model in every side call and forwarded body. The hub reads ``/models``
and, for models that run, ``/props?model=ID&autoload=false``; a model that is not
loaded keeps a layout (from its child's arguments, or the last one seen), so its requests
are counted, admitted and refused as when it runs, and the router loads it when the first
of them reaches it (:mod:`gateway.backends.router_gate` handles ``--models-max``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import httpx

from gateway.admission.slotwatch import SlotView, parse_slots
from gateway.backends.base import Discovered, SideCalls, auth_problem, error_message
from gateway.backends.llamacpp import SLOTS_TIMEOUT_S, LlamaCpp
from gateway.backends.router_gate import ModelsMaxGate
from gateway.backends.upstream import map_upstream_errors
from gateway.clock import Clock
from gateway.config import BackendSettings
from gateway.core.capacity import Charge
from gateway.core.prefix import digest
from gateway.errors import (
    BackendNotReady,
    GatewayError,
    UpstreamAuthFailed,
    UpstreamError,
    UpstreamKind,
    UpstreamUnavailable,
)
from gateway.wire.builds import BuildReport
from gateway.wire.validation import ParsedRequest

if TYPE_CHECKING:
    from gateway.backends.target import Target

__all__ = ["RUNNING", "LayoutUnknown", "ModelEntry", "RouterHub", "RouterModel",
           "RouterSideCalls", "child_layout", "child_options", "for_model", "member_settings",
           "parse_models"]

log = logging.getLogger(__name__)

#: States in which a model's child process exists and counts against ``--models-max``
#: (``server_model_meta::is_running``, ``tools/server/server-models.h``).
RUNNING = frozenset({"loaded", "loading", "sleeping"})
FRESH_S = 0.5  # a hub read this recent is not repeated for a member's discovery
KV_PAD = 256  # llama_context pads n_ctx (and n_ctx_seq per-slot) to 256 cells
AUTO_SLOTS = 4  # -np unset (-1 = auto): 4 slots and a unified pool (tools/server/server.cpp)
# Options update_args() sets anew for every load (server-models.cpp): not part of what
# decides the child's layout.
_PER_LOAD = {"--host", "--port", "--alias", "--log-colors"}
# The router's own refusals of a request for one of its models (server-models.cpp:
# ensure_model_ready, proxy_request, router_validate_model, load), as ex_wrapper renders
# them (tools/server/server.cpp): the model is loading, gone, or failed to load, never
# the client's mistake.
_ROUTER_FAULT = re.compile(
    r"^(model name=.* (failed to load|is not running|is not found)|model is not loaded"
    r"|model '.*' not found|model limit reached|failed to spawn server instance"
    r"|failed to get a port number|request cancelled while waiting for model)")


@dataclass(frozen=True)
class ModelEntry:
    """One model of ``GET /models`` (``get_router_models``, ``server-models.cpp``).

    :param id: its name (``data[].id``): the file name without ``.gguf`` for
        ``--models-dir``, the section name for ``--models-preset``.
    :param status: ``status.value``.
    :param args: ``status.args``, its child's command line (binary first).
    :param aliases: ``aliases`` (further names the router resolves to it).
    :param failed: ``status.failed``: the last load exited with ``exit_code``.
    :param exit_code: ``status.exit_code`` of a failed load.
    :param meta: the loaded child's ``meta`` (``n_vocab``, ``n_ctx``, ``n_ctx_train``…),
        merged into the entry while it runs; empty otherwise.
    """

    id: str
    status: str
    args: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    failed: bool = False
    exit_code: int | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def running(self) -> bool:
        """Its child process exists (it counts against ``--models-max``)."""
        return self.status in RUNNING

    @property
    def state(self) -> str:
        """``status.value``, or ``"failed"`` for an unloaded model whose load failed."""
        return "failed" if self.failed and not self.running else self.status

    @property
    def layout_args(self) -> tuple[str, ...]:
        """:attr:`args` without the binary and the options set anew at each load
        (host, port, alias): equal for two loads of the same preset."""
        out: list[str] = []
        args = list(self.args[1:] if self.args and not self.args[0].startswith("-")
                    else self.args)
        skip = False
        for i, arg in enumerate(args):
            if skip:
                skip = False
                continue
            if arg in _PER_LOAD:
                skip = i + 1 < len(args) and not args[i + 1].startswith("--")
                continue
            out.append(arg)
        return tuple(out)


def parse_models(data: Any) -> dict[str, ModelEntry]:
    """The entries of a ``GET /models`` answer, by id.

    :raises ValueError: it is not the router's shape (``data`` of objects with a string
        ``id`` and a ``status`` object).
    """
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise ValueError("no data list")
    found: dict[str, ModelEntry] = {}
    for item in data["data"]:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            raise ValueError("a model without a string id")
        status = item.get("status")
        if not isinstance(status, dict) or not isinstance(status.get("value"), str):
            raise ValueError(f"model {item['id']!r} has no status object")
        args, aliases, meta = status.get("args"), item.get("aliases"), item.get("meta")
        args = args if isinstance(args, list) else []
        aliases = aliases if isinstance(aliases, list) else []
        meta = meta if isinstance(meta, dict) else {}
        code = status.get("exit_code")
        found[item["id"]] = ModelEntry(
            id=item["id"], status=status["value"], args=tuple(str(a) for a in args),
            aliases=tuple(str(a) for a in aliases if isinstance(a, str) and a),
            failed=bool(status.get("failed")),
            exit_code=code if isinstance(code, int) else None, meta=meta)
    return found


def _pad(n: int) -> int:
    return -(-n // KV_PAD) * KV_PAD


_ALIASES = {"-c": "--ctx-size", "-np": "--parallel", "-kvu": "--kv-unified",
            "-no-kvu": "--no-kv-unified", "-m": "--model", "-ctk": "--cache-type-k",
            "-ctv": "--cache-type-v", "-mm": "--mmproj", "-md": "--spec-draft-model",
            "--model-draft": "--spec-draft-model"}


def child_options(args: tuple[str, ...]) -> dict[str, str | None]:
    """The last value of each option of a child's command line (``status.args``), by
    its long name (``-c`` is ``--ctx-size``, ``-m`` ``--model``, ``-np`` ``--parallel``,
    ``-ctk``/``-ctv`` the cache types; ``None`` for a bare flag); a value is the next
    argument unless it is another option (``-1`` is a value)."""
    found: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if not arg.startswith("-") or arg.lstrip("-").isdigit():
            continue
        nxt = args[i + 1] if i + 1 < len(args) else None
        value = nxt if nxt is not None and (not nxt.startswith("-")
                                            or nxt.lstrip("-").isdigit()) else None
        found[_ALIASES.get(arg, arg)] = value
    return found


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def _kv_unified(args: tuple[str, ...]) -> bool:
    """The last of ``--kv-unified`` and ``--no-kv-unified`` given (off when neither)."""
    flag = False
    for arg in args:
        name = _ALIASES.get(arg, arg)
        if name in ("--kv-unified", "--no-kv-unified"):
            flag = name == "--kv-unified"
    return flag


def child_layout(args: tuple[str, ...]) -> tuple[bool, Discovered | None]:
    """What a child started with ``args`` (``status.args``) holds, as llama-server
    computes it: ``-np`` unset or -1 means 4 slots sharing one pool (``--kv-unified``
    forced, ``tools/server/server.cpp``); otherwise the pool is unified only with
    ``--kv-unified`` (``common/arg.cpp``). ``-c`` is padded to 256 cells, and a per-slot
    pool gives each slot ``pad(-c / -np)`` (``src/llama-context.cpp``);
    ``--kv-unified-per-slot N`` caps a slot at N and, without ``-c``, sizes the pool to
    ``-np x N`` (``tools/server/server.cpp``). A slot is also capped at the model's
    training context, which only a loaded child shows: the hub prefers the last
    ``/props`` seen for the same arguments.

    :returns: (the pool is unified, the layout as :class:`Discovered`, ``None`` when the
        arguments do not give the context: ``-c`` unset or 0 means the model's own).
    """
    opts = child_options(args)
    slots = _int(opts.get("--parallel"), -1)
    unified = True if slots < 0 else _kv_unified(args)
    slots = AUTO_SLOTS if slots < 0 else slots
    n_ctx = _int(opts.get("--ctx-size"), 0)
    per_slot = _int(opts.get("--kv-unified-per-slot"), 0)
    if per_slot > 0 and "--ctx-size" not in opts:
        n_ctx = slots * per_slot
    if n_ctx <= 0 or slots < 1:
        return unified, None
    n_ctx = _pad(n_ctx)
    seq = n_ctx if unified else _pad(n_ctx // slots)
    ctx = min(seq, per_slot) if per_slot > 0 else seq
    if ctx < 2:
        return unified, None
    return unified, Discovered(slots=slots, ctx_per_slot=ctx,
                               pool_tokens=n_ctx if unified else None)


def member_settings(hub: BackendSettings, entry: ModelEntry, unified: bool
                    ) -> BackendSettings:
    """The settings of ``entry``'s member target: the hub's connection settings (URL,
    key, timeouts), named ``<hub>/<id>``, serving model ``id`` (and the router's
    aliases of it), its pool shared as its child's is; the hub's layout limits (slots,
    context, pool) are not carried over, each model's child has its own."""
    return hub.model_copy(update={
        "name": f"{hub.name}/{entry.id}", "model": entry.id,
        "aliases": [a for a in entry.aliases if a != entry.id],
        "slots": None, "ctx_per_slot": None, "pool_tokens": None, "kv_unified": unified})


def for_model(model_id: str, method: str, path: str, body: bytes) -> tuple[str, bytes]:
    """A side route relayed to one model of a router (``path`` with its query, and the
    body): a GET gets ``model=ID`` in its query (``autoload=false`` unless the client
    set it), a POST's JSON object body gets ``model`` set to the id, so that the router
    forwards it to that model's child whatever name the client used (``proxy_get``,
    ``proxy_post``)."""
    if method != "POST":
        base, _, query = path.partition("?")
        params = {k: v for k, v in (p.split("=", 1) if "=" in p else (p, "")
                                    for p in query.split("&") if p) if k != "model"}
        params.setdefault("autoload", "false")
        return f"{base}?{urlencode({'model': model_id, **params})}", body
    try:
        parsed = json.loads(body or b"{}")
    except ValueError:
        return path, body
    if not isinstance(parsed, dict):
        return path, body
    return path, json.dumps({**parsed, "model": model_id}).encode()


class RouterSideCalls(SideCalls):
    """A member's side calls: each GET carries ``?model=ID&autoload=false`` (so that
    discovery and ``/slots`` never load a model), each POST the model in its body (the
    router forwards by it, loading the model first: counting waits for a load).

    :param model_id: the model's id at the router.
    """

    def __init__(self, settings: BackendSettings, client: httpx.AsyncClient,
                 model_id: str) -> None:
        super().__init__(settings, client)
        self.model_id = model_id

    async def get(self, path: str, *, timeout_s: float | None = None) -> httpx.Response:
        """``GET path?model=ID&autoload=false``."""
        sep = "&" if "?" in path else "?"
        query = urlencode({"model": self.model_id, "autoload": "false"})
        return await super().get(f"{path}{sep}{query}", timeout_s=timeout_s)

    async def post(self, path: str, body: dict[str, Any], *,
                   timeout_s: float | None = None) -> httpx.Response:
        """``POST path`` with ``body``'s ``model`` set to the member's model."""
        return await super().post(path, {**body, "model": self.model_id},
                                  timeout_s=timeout_s)


class RouterModel(LlamaCpp):
    """llama-server's dialect for one model of a router (a member target): the model in
    every side call (:class:`RouterSideCalls`) and forwarded body, its layout from the
    hub, and the router's own refusals read as "loading" rather than as the client's
    mistakes.

    :param settings: the member's settings (:func:`member_settings`).
    :param side: its :class:`RouterSideCalls`.
    :param hub: the router's :class:`RouterHub`.
    :param model_id: the model's id at the router.
    """

    model_id: str  # (always known here: the router named it)

    def __init__(self, settings: BackendSettings, side: RouterSideCalls, hub: RouterHub,
                 model_id: str) -> None:
        super().__init__(settings, side)
        self.hub = hub
        self.model_id = model_id

    async def calibrate(self) -> float | None:
        """``None``: a request would make the router load the model (its pace comes
        from its answers instead)."""
        return None

    async def survey(self) -> BuildReport:
        """Nothing asked, for the same reason: a survey request would load the model."""
        return BuildReport()

    async def discover(self) -> Discovered:
        """The model's layout as the hub last read it (read again first unless the hub
        is reading now or read under :data:`FRESH_S` ago). A model whose layout is not
        known yet (never loaded, no ``-c`` in its arguments) is loaded now, through
        ``POST /models/load``, so that the next discovery finds it.

        :raises BackendNotReady: the router no longer lists the model, or its layout is
            not known yet.
        :raises UpstreamError: as :meth:`RouterHub.read`.
        """
        hub = self.hub
        if not hub.passing and not hub.fresh():
            await hub.read()
        try:
            found = hub.found(self.model_id)
        except LayoutUnknown:
            if not hub.passing:
                hub.load_to_learn(self.model_id)
            raise
        self.n_vocab = found.n_vocab
        return found

    def prepare_body(self, req: ParsedRequest, charge: Charge) -> dict[str, Any]:
        """llama-server's body (:meth:`LlamaCpp.prepare_body`) with ``model`` set to the
        router's id of the model, whatever name or alias the client used: the router
        forwards by it (``proxy_post``). Notes the use for ``--models-max``."""
        body = super().prepare_body(req, charge)
        body["model"] = self.model_id
        self.hub.gate.used(self.model_id)
        return body

    async def count_prompt(self, route: str, body: dict[str, Any]) -> int | None:
        """Count as llama-server does (:meth:`LlamaCpp.count_prompt`) on the model's own
        child. For a model not running, after its turn under ``--models-max``
        (:meth:`~gateway.backends.router_gate.ModelsMaxGate.turn`, at most
        ``read_timeout_s``): the router loads it first, and the count waits for it (at
        most the side timeout; past it, the gateway estimates)."""
        gate = self.hub.gate
        gate.counting(self.model_id, 1)
        try:
            await gate.turn(self.model_id, self.settings.read_timeout_s)
            return await super().count_prompt(route, body)
        finally:
            gate.counting(self.model_id, -1)

    async def read_slots(self) -> list[SlotView]:
        """``GET /slots?model=ID&autoload=false`` while the model's child runs. A model
        not loaded or asleep runs no task (an unloaded child has exited; a sleeping one
        went to sleep idle, and ``/slots`` would wake it): everything the slot watch
        holds has ended.

        :raises UpstreamUnavailable: the model is not running or asleep.
        :raises UpstreamError: it is loading (nothing to read yet), or an odd answer.
        """
        hub = self.hub
        entry = hub.entries.get(self.model_id)
        if entry is None or entry.status != "loaded":
            if not hub.fresh():
                await hub.read()
            entry = hub.entries.get(self.model_id)
        if entry is None or entry.status in ("unloaded", "sleeping"):
            raise UpstreamUnavailable(
                f"Backend {self.name!r}: model {self.model_id!r} is "
                f"{entry.status if entry else 'gone'}; none of its tasks runs.")
        if entry.status != "loaded":
            raise UpstreamError(f"Backend {self.name!r}: model {self.model_id!r} is "
                                f"{entry.status}.")
        with map_upstream_errors(self.name):
            resp = await self.side.get("/slots", timeout_s=SLOTS_TIMEOUT_S)
        if resp.status_code != 200 and self._router_fault(resp.content):
            raise UpstreamUnavailable(f"Backend {self.name!r}: {error_message(resp.content)}")
        if resp.status_code != 200:
            raise UpstreamError(f"Backend {self.name!r} answered /slots with HTTP "
                                f"{resp.status_code}")
        try:
            return parse_slots(resp.json())
        except ValueError as exc:
            raise UpstreamError(f"Backend {self.name!r} answered /slots oddly: {exc}") from exc

    def _router_fault(self, body: bytes) -> str | None:
        """The router's refusal of a request for this model (:data:`_ROUTER_FAULT`), or
        ``None`` for anything else."""
        message = error_message(body).strip()
        return message if _ROUTER_FAULT.match(message) else None

    def _not_ready(self, message: str) -> BackendNotReady:
        """The 503 of a router refusal: the model is loading, gone, or failed to load
        (with its exit code, from ``/models``), Retry-After the model's load time."""
        entry = self.hub.entries.get(self.model_id)
        detail = (f" (its last load exited with code {entry.exit_code})"
                  if entry is not None and entry.failed and entry.exit_code else "")
        return BackendNotReady(
            f"Backend {self.name!r}: the router could not serve model {self.model_id!r} "
            f"now: {message}{detail}; retry after the Retry-After delay.",
            retry_after_s=self.hub.gate.retry_after_s(self.model_id),
            kind=UpstreamKind.status_5xx)

    def _refused(self, resp: httpx.Response) -> int | None:
        """As :meth:`LlamaCpp._refused`, the router's own refusals raised as
        :class:`BackendNotReady` (a 400 "model is not loaded" is not the client's)."""
        message = self._router_fault(resp.content)
        if message is not None:
            raise self._not_ready(message)
        return super()._refused(resp)

    def translate_error(
        self, status: int, body: bytes, retry_after: str | None, *, retry_after_s: float
    ) -> GatewayError | None:
        """As :meth:`LlamaCpp.translate_error`; the router's refusals (a load that failed:
        500 "model name=X failed to load"; a model gone or not running) become a 503
        with the router's reason."""
        message = self._router_fault(body) if status >= 400 else None
        if message is not None:
            return self._not_ready(message)
        return super().translate_error(status, body, retry_after, retry_after_s=retry_after_s)


class LayoutUnknown(BackendNotReady):
    """A router's model whose layout is not known yet: never seen loaded, and its
    arguments do not give its context (``-c`` unset: the model's own)."""


class RouterHub:
    """What one router shows of its models, read by its hub target's discovery.

    :param name: the hub backend's name.
    :param side: the hub's side calls.
    :param clock: the injected clock.
    :param full_pass: runs one discovery of the hub target (router ``/props``,
        ``/models``, the members' layouts, then :meth:`ModelsMaxGate.rebalance`); the
        gate's poll calls it while loads are pending.

    :ivar max_instances: ``--models-max`` (``/props`` ``max_instances``; 0: no limit).
    :ivar autoload: ``models_autoload``: the router loads a model on a request for it.
    :ivar entries: the last ``GET /models`` read, by model id.
    :ivar members: the member target of each model, kept by the fleet.
    :ivar gate: the :class:`~gateway.backends.router_gate.ModelsMaxGate`.
    """

    def __init__(self, name: str, side: SideCalls, clock: Clock,
                 full_pass: Callable[[], Awaitable[Any]]) -> None:
        self.name = name
        self.side = side
        self.clock = clock
        self.max_instances = 0
        self.autoload = True
        self.entries: dict[str, ModelEntry] = {}
        self.members: dict[str, Target] = {}
        self.passing = False  # the hub's discovery is handing layouts to the members
        self.read_at: float | None = None
        self._seen: dict[str, tuple[tuple[str, ...], Discovered]] = {}
        self._lock = asyncio.Lock()
        self._reloading = False  # the read under the lock is a reload
        self._loads: set[asyncio.Task[None]] = set()
        self._asked: dict[str, float] = {}  # load_to_learn: when each model was asked
        self.gate = ModelsMaxGate(self, clock, full_pass)

    def take_props(self, props: dict[str, Any]) -> None:
        """The router's ``/props``: ``max_instances`` and ``models_autoload``."""
        count = props.get("max_instances")
        self.max_instances = count if isinstance(count, int) and count > 0 else 0
        self.autoload = props.get("models_autoload") is not False

    def fresh(self) -> bool:
        """Read under :data:`FRESH_S` ago."""
        return self.read_at is not None and self.clock.now() - self.read_at < FRESH_S

    async def read(self, *, reload: bool = False) -> None:
        """Read ``GET /models`` (``?reload=1`` with ``reload``: the router re-reads its
        presets and models directory first, ``server-models.cpp``), then
        ``/props?model=ID&autoload=false`` of each model that runs (a sleeping child
        answers ``/props`` from its cache without waking, ``server-context.cpp``). One
        read at a time: a caller arriving during one waits for it instead of starting
        another; a reload arriving during a plain read then starts its own, during a
        reload it joins that one (so a burst of reloads is one or two at the router).

        :raises UpstreamAuthFailed: 401/403, the gateway's key.
        :raises UpstreamUnavailable: the router cannot be reached.
        :raises UpstreamError: an answer that is not the router's ``/models`` shape.
        """
        if self._lock.locked() and (not reload or self._reloading):
            async with self._lock:
                return
        async with self._lock:
            self._reloading = reload
            try:
                await self._read(reload)
            finally:
                self._reloading = False

    async def _read(self, reload: bool) -> None:
        """:meth:`read`'s work, under its lock."""
        with map_upstream_errors(self.name):
            resp = await self.side.get("/models?reload=1" if reload else "/models")
        if resp.status_code in (401, 403):
            raise UpstreamAuthFailed(auth_problem(
                self.name, resp.status_code, self.side.settings.api_key is not None,
                "llama-server"))
        try:
            entries = parse_models(resp.json())
        except ValueError as exc:
            raise UpstreamError(f"Backend {self.name!r} (a llama-server router) "
                                f"answered /models with HTTP {resp.status_code} that "
                                f"is not the router's shape: {exc}") from exc
        self.gate.observe(self.entries, entries)
        self.entries = entries
        for entry in entries.values():
            if entry.running and entry.status != "loading":
                with contextlib.suppress(GatewayError, ValueError, KeyError, TypeError):
                    await self._read_props(entry)
        self.read_at = self.clock.now()

    async def _read_props(self, entry: ModelEntry) -> None:
        """``/props?model=ID&autoload=false``: the running child's slots and context,
        kept as the last layout seen for its arguments."""
        query = urlencode({"model": entry.id, "autoload": "false"})
        with map_upstream_errors(self.name):
            resp = await self.side.get(f"/props?{query}")
        if resp.status_code != 200:
            return
        props = resp.json()
        slots = int(props["total_slots"])
        ctx = int(props["default_generation_settings"]["n_ctx"])
        unified, derived = child_layout(entry.args)
        pool = (derived.pool_tokens if derived is not None and derived.pool_tokens
                else ctx) if unified else None
        shown = [props.get(k) for k in ("model_path", "chat_template", "build_info")]
        n_vocab = entry.meta.get("n_vocab")
        self._seen[entry.id] = (entry.layout_args, Discovered(
            slots=slots, ctx_per_slot=ctx, pool_tokens=max(pool, ctx) if pool else None,
            n_vocab=n_vocab if isinstance(n_vocab, int) and n_vocab > 0 else None,
            model_id=entry.id, fingerprint=digest(shown) if any(shown) else None))

    def unified(self, model_id: str) -> bool:
        """The model's child shares one pool among its slots (:func:`child_layout`)."""
        entry = self.entries.get(model_id)
        return child_layout(entry.args)[0] if entry is not None else True

    def found(self, model_id: str) -> Discovered:
        """The model's layout: the last ``/props`` seen for its present arguments, else
        the layout its arguments give (:func:`child_layout`), else the last seen.

        :raises BackendNotReady: the router no longer lists it.
        :raises LayoutUnknown: never seen loaded, and its arguments do not give it.
        """
        entry = self.entries.get(model_id)
        if entry is None:
            raise BackendNotReady(f"Backend {self.name!r} (a llama-server router) no "
                                  f"longer lists model {model_id!r}.")
        seen = self._seen.get(model_id)
        if seen is not None and seen[0] == entry.layout_args:
            return seen[1]
        derived = child_layout(entry.args)[1]
        if derived is not None:
            last = seen[1] if seen is not None else None
            return replace(derived, model_id=model_id,
                           n_vocab=last.n_vocab if last else None,
                           fingerprint=last.fingerprint if last else None)
        if seen is not None:
            return seen[1]
        raise LayoutUnknown(
            f"Model {model_id!r} of router {self.name!r} is not loaded and its arguments "
            "do not give its context (-c); the gateway has it loaded to read its layout. "
            "Retry after the Retry-After delay.",
            retry_after_s=self.gate.retry_after_s(model_id))

    def load_to_learn(self, model_id: str) -> None:
        """Have the router load ``model_id`` (``POST /models/load``, in the background)
        so that its layout can be read; at most once per model every 10 s, only while
        the router autoloads (with ``--no-models-autoload`` the operator loads models)."""
        now = self.clock.now()
        entry = self.entries.get(model_id)
        if (not self.autoload or entry is None or entry.running
                or now - self._asked.get(model_id, -1e9) < 10.0):
            return
        self._asked[model_id] = now
        self.gate.wanted(model_id)

        async def load() -> None:
            with contextlib.suppress(GatewayError):
                with map_upstream_errors(self.name):
                    resp = await self.side.post("/models/load", {"model": model_id})
                if resp.status_code != 200:
                    log.info("router %s did not load %s: %s", self.name, model_id,
                             error_message(resp.content))

        task = asyncio.ensure_future(load())
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)

    def listing(self) -> list[dict[str, Any]]:
        """The models as ``GET /v1/models`` lists them through the gateway: id, aliases,
        ``status.value`` (and ``failed``/``exit_code`` of a failed load), the loaded
        child's ``meta``; never ``status.args`` nor the preset (file paths)."""
        out = []
        for entry in self.entries.values():
            status: dict[str, Any] = {"value": entry.status}
            if entry.failed:
                status.update(failed=True, exit_code=entry.exit_code)
            item: dict[str, Any] = {"id": entry.id, "object": "model",
                                    "owned_by": "llamacpp", "aliases": list(entry.aliases),
                                    "status": status}
            if entry.meta:
                item["meta"] = entry.meta
            out.append(item)
        return out

    async def listed(self, *, reload: bool = False) -> list[dict[str, Any]]:
        """:meth:`listing` after a fresh read (the last one when the router does not
        answer); with ``reload``, the router re-reads its models first (:meth:`read`)."""
        with contextlib.suppress(GatewayError):
            await self.read(reload=reload)
        return self.listing()

    def rows(self) -> list[tuple[str, str, bool, int, float | None]]:
        """For each member: (backend name, model state, held for another's load, holds
        placed so far, learned load time in seconds or ``None``)."""
        gate = self.gate
        return [(member.name, entry.state if entry else "gone",
                 model_id in gate.holds, gate.holds_placed[model_id],
                 gate.load_s.get(model_id))
                for model_id, member in self.members.items()
                for entry in (self.entries.get(model_id),)]

    async def close(self) -> None:
        """Stop the loads asked and the gate's holds and poll (shutdown, retirement)."""
        for task in list(self._loads):
            task.cancel()
        await asyncio.gather(*self._loads, return_exceptions=True)
        await self.gate.close()
