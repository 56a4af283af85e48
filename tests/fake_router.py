"""A fake llama-server in router mode, behind httpx.MockTransport.

Built from ``tools/server/server-models.cpp`` and ``tools/server/server.cpp`` of the
llama.cpp build the project uses (facts only):

* ``GET /props`` without ``model``: ``{"role": "router", "max_instances",
  "models_autoload", "model_alias": "llama-server", "model_path": "none",
  "default_generation_settings": {"params": {}, "n_ctx": 0}, ...}`` (``get_router_props``);
  with ``?model=``, and every other GET (``/slots``), forwarded to that model's child
  (``proxy_get``).
* ``GET /models`` (and ``/v1/models``): ``data[]`` of ``id``, ``aliases``, ``object``,
  ``owned_by``, ``status`` (``value``; ``args``; ``failed``/``exit_code`` after a failed
  load), and the loaded child's ``meta`` merged in (``get_router_models``).
* POSTs forwarded by the body's ``model`` (``proxy_post``): missing → 400 "model name is
  missing from the request"; unknown → 400 "model 'X' not found"; not running with
  autoload off (``?autoload=false`` or ``--no-models-autoload``) → 400 "model is not
  loaded" (``router_validate_model``). Otherwise the request waits for the model
  (``ensure_model_ready``): one queue entry per model, loads in queue order while fewer
  than ``models_max`` children run, the least recently used *idle* model (no request in
  flight, none queued for it) unloaded while queued models outnumber free places
  (``server_lru_sched``); a load that fails leaves it ``unloaded`` with
  ``failed``/``exit_code`` and answers its waiters 500 "model name=X failed to load".
* ``POST /models/load``: 400 "model is already running" when it runs; when the limit is
  reached the LRU idle model is unloaded first, else 500 "model limit reached, try again
  later" (``load``, ``unload_lru``). ``POST /models/unload``.

Each model's child is a :class:`tests.fakes.FakeLlamaServer` (its own slots and pool).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import httpx

from tests.fakes import FakeLlamaServer

RUNNING = ("loaded", "loading", "sleeping")


def child_args(model_id: str, *extra: str, port: int = 0) -> list[str]:
    """A child's command line as ``update_args`` renders it (long forms, the binary
    first, host/port/alias set by the router)."""
    return ["/opt/llama/llama-server", "--host", "127.0.0.1", "--port", str(port),
            "--alias", model_id, "--model", f"/srv/models/{model_id}.gguf", *extra]


@dataclass
class FakeRouter:
    """Answers like llama-server started as a router.

    :param children: each model's child, by model id.
    :param args: each model's extra child arguments (``--ctx-size 2048`` by default).
    :param models_max: ``--models-max`` (0: no limit).
    :param autoload: ``--models-autoload``.
    :param loaded: models loaded at start.
    :param load_gate: when set, a load finishes only once it is set.
    :param fail: models whose child exits with code 1 while loading.
    """

    children: dict[str, FakeLlamaServer]
    args: dict[str, list[str]] = field(default_factory=dict)
    models_max: int = 4
    autoload: bool = True
    loaded: set[str] = field(default_factory=set)
    load_gate: asyncio.Event | None = None
    fail: set[str] = field(default_factory=set)
    aliases: dict[str, list[str]] = field(default_factory=dict)
    reload_gate: asyncio.Event | None = None  # when set, GET /models?reload=1 waits on it
    status: dict[str, str] = field(default_factory=dict)
    exit_code: dict[str, int] = field(default_factory=dict)
    req_count: Counter[str] = field(default_factory=Counter)
    last_used: dict[str, float] = field(default_factory=dict)
    queue: list[str] = field(default_factory=list)  # models requests wait for, in order
    loads: list[str] = field(default_factory=list)
    unloads: list[str] = field(default_factory=list)
    requests: list[httpx.Request] = field(default_factory=list)
    forwarded: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    peak_running: int = 0
    _tick: int = 0
    _cond: asyncio.Condition | None = None

    def __post_init__(self) -> None:
        for model_id in self.children:
            self.status.setdefault(model_id, "loaded" if model_id in self.loaded
                                   else "unloaded")
            self.args.setdefault(model_id, ["--ctx-size", "2048"])

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle))

    @property
    def cond(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def _changed(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    def running(self) -> list[str]:
        return [m for m, s in self.status.items() if s in RUNNING]

    # -- the router's own answers (sync: the probe's client is synchronous) ---------------

    def router_props(self) -> dict[str, Any]:
        return {"role": "router", "max_instances": self.models_max,
                "models_autoload": self.autoload, "model_alias": "llama-server",
                "model_path": "none",
                "default_generation_settings": {"params": {}, "n_ctx": 0},
                "ui_settings": {}, "build_info": "b11434-fake", "cors_proxy_enabled": False}

    def models_json(self) -> dict[str, Any]:
        data = []
        for model_id, child in self.children.items():
            state = self.status[model_id]
            status: dict[str, Any] = {"value": state, "args": child_args(
                model_id, *self.args[model_id], port=8100 if state in RUNNING else 0)}
            if state == "unloaded" and self.exit_code.get(model_id):
                status.update(exit_code=self.exit_code[model_id], failed=True)
            entry: dict[str, Any] = {
                "id": model_id, "aliases": self.aliases.get(model_id, []), "tags": [],
                "object": "model", "owned_by": "llamacpp", "created": 0, "status": status,
                "source": "models_dir", "can_remove": False}
            if state in RUNNING:
                entry["meta"] = {"n_vocab": child.n_vocab, "n_ctx": child.n_ctx,
                                 "n_ctx_train": 32768}
            data.append(entry)
        return {"data": data, "object": "list"}

    def get_sync(self, path: str, query: dict[str, str]) -> httpx.Response | None:
        """The GETs answered without a child, or ``None`` to forward."""
        if path == "/props" and "model" not in query:
            return httpx.Response(200, json=self.router_props())
        if path in ("/models", "/v1/models"):
            return httpx.Response(200, json=self.models_json())
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if path == "/tools":  # the router's own (tools/server/server.cpp), as with no tools
            return httpx.Response(403, json={"error": {
                "message": "this feature is disabled", "type": "feature_disabled"}})
        return None

    def _validate(self, name: str, autoload: bool) -> httpx.Response | None:
        if not name:
            return _error(400, "model name is missing from the request")
        if name not in self.children:
            return _error(400, f"model '{name}' not found")
        if not autoload and self.status[name] not in RUNNING:
            return _error(400, "model is not loaded")
        return None

    # -- transport --------------------------------------------------------------------

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        query = {k: v[-1] for k, v in parse_qs(request.url.query.decode()).items()}
        autoload = self.autoload if "autoload" not in query else query["autoload"] in (
            "true", "1")
        if request.method == "GET":
            if path == "/models" and query.get("reload") and self.reload_gate is not None:
                await self.reload_gate.wait()
            answer = self.get_sync(path, query)
            if answer is not None:
                return answer
            name = query.get("model", "")
            refused = self._validate(name, autoload)
            if refused is not None:
                return refused
            if autoload and (failed := await self._ensure(name)) is not None:
                return failed
            if self.status[name] not in RUNNING:
                return _error(400, f"model name={name} is not running")
            return await self.children[name].handle(httpx.Request(
                "GET", f"http://child{path}", headers=request.headers))
        body = json.loads(request.content or b"{}")
        name = str(body.get("model") or "")
        if path == "/tools":
            return self.get_sync(path, query) or _error(500, "unreachable")
        if path == "/models/load":
            return await self._load_route(name)
        if path == "/models/unload":
            if self.status.get(name) not in RUNNING:
                return _error(400, "model is not running")
            await self._unload(name)
            return httpx.Response(200, json={"success": True})
        refused = self._validate(name, autoload)
        if refused is not None:
            return refused
        if autoload and (failed := await self._ensure(name)) is not None:
            return failed
        if self.status[name] not in RUNNING:
            return _error(400, f"model name={name} is not running")
        return await self._proxy(name, request, path, body)

    async def _proxy(self, name: str, request: httpx.Request, path: str,
                     body: dict[str, Any]) -> httpx.Response:
        self._tick += 1
        self.last_used[name] = self._tick
        self.req_count[name] += 1
        self.forwarded.append((name, path, body))
        try:
            resp = await self.children[name].handle(httpx.Request(
                "POST", f"http://child{path}", headers=request.headers,
                content=request.content))
        except BaseException:
            await self._done(name)
            raise
        if isinstance(resp.stream, httpx.AsyncByteStream) and not hasattr(resp, "_content"):
            return httpx.Response(resp.status_code, headers=resp.headers,
                                  stream=_Counted(self, name, resp.stream))
        await self._done(name)
        return resp

    async def _done(self, name: str) -> None:
        self.req_count[name] -= 1
        await self._changed()

    # -- loading and unloading ----------------------------------------------------------

    def _victim(self) -> str | None:
        idle = [m for m in self.running() if self.status[m] == "loaded"
                and self.req_count[m] == 0 and m not in self.queue]
        return min(idle, key=lambda m: self.last_used.get(m, 0), default=None)

    async def _unload(self, name: str) -> None:
        self.status[name] = "unloaded"
        self.unloads.append(name)
        await self._changed()

    def _start_load(self, name: str) -> None:
        """Spawn ``name``'s child: ``loading`` at once, ``loaded`` (or failed) later."""
        self.status[name] = "loading"
        self.exit_code.pop(name, None)
        self.loads.append(name)
        self.peak_running = max(self.peak_running, len(self.running()))
        asyncio.ensure_future(self._finish_load(name))

    async def _finish_load(self, name: str) -> None:
        await self._changed()
        if self.load_gate is not None:
            await self.load_gate.wait()
        await asyncio.sleep(0)
        if name in self.fail:
            self.status[name] = "unloaded"
            self.exit_code[name] = 1
        else:
            self.status[name] = "loaded"
        await self._changed()

    async def _load_route(self, name: str) -> httpx.Response:
        if name not in self.children:
            return _error(404, "model is not found")
        if self.status[name] in RUNNING:
            return _error(400, "model is already running")
        if self.models_max and len(self.running()) >= self.models_max:
            victim = self._victim()
            if victim is None:
                return _error(500, "model limit reached, try again later")
            await self._unload(victim)
        self._start_load(name)
        await asyncio.sleep(0)
        return httpx.Response(200, json={"success": True})

    async def _ensure(self, name: str) -> httpx.Response | None:
        """``ensure_model_ready``: wait until ``name`` is loaded, loading it in turn."""
        if self.status[name] in ("loaded", "sleeping"):
            return None
        self.queue.append(name)
        saw_loading = False
        try:
            async with self.cond:
                while True:
                    state = self.status[name]
                    if state == "loaded":
                        return None
                    if state == "loading":
                        saw_loading = True
                    elif saw_loading:  # it came back down: the load failed
                        return _error(500, f"model name={name} failed to load")
                    elif self.queue[0] == name:
                        if not self.models_max or len(self.running()) < self.models_max:
                            saw_loading = True
                            self._start_load(name)
                        elif (victim := self._victim()) is not None:
                            self.status[victim] = "unloaded"
                            self.unloads.append(victim)
                            continue
                    await self.cond.wait()
        finally:
            self.queue.remove(name)


class _Counted(httpx.AsyncByteStream):
    """A child's stream, counted in the router's ``req_count`` until it ends."""

    def __init__(self, router: FakeRouter, name: str, inner: httpx.AsyncByteStream) -> None:
        self.router, self.name, self.inner, self.ended = router, name, inner, False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.inner:
                yield chunk
        finally:
            await self._end()

    async def _end(self) -> None:
        if not self.ended:
            self.ended = True
            await self.router._done(self.name)

    async def aclose(self) -> None:
        await self.inner.aclose()
        await self._end()


def _error(status: int, message: str) -> httpx.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return httpx.Response(status, json={"error": {"code": status, "message": message,
                                                  "type": kind}})
