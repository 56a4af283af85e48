"""Running the gateway under uvicorn, with a graceful drain on SIGTERM and SIGINT.

uvicorn, on the first signal, stops listening at once and gives open requests
``timeout_graceful_shutdown`` seconds. A gateway in front of slow generations needs more
than that, and load balancers need to be told first. So the first signal starts a drain
(:meth:`gateway.fleet.state.GatewayState.drain`): ``/ready`` turns 503 and new requests get 503
``shutting_down`` while the server still listens; requests in flight, and queued ones
unless ``server.drain_queued = "refuse"``, get ``server.drain_timeout_s`` to finish.
Then uvicorn's own shutdown runs, which cuts what is left (each request's lease is
released in its ``finally``). A second signal skips the rest of the drain. The process
exits 0, without re-raising the signal as uvicorn otherwise does.

SIGHUP reloads the configuration file without a restart
(:func:`gateway.fleet.reload.reload_config`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import multiprocessing
import os
import resource
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import uvicorn

from gateway.config import Settings, open_files_needed
from gateway.errors import GatewayError
from gateway.fleet.reload import reload_config
from gateway.http.app import uvicorn_options
from gateway.tasks import cancel_bounded, end_leftovers

__all__ = ["DrainingServer", "listen_hosts", "serve", "serve_workers"]

log = logging.getLogger(__name__)

#: Seconds a task still running after the shutdown gets to end by itself, then seconds
#: it gets once cancelled (see :func:`_end_leftovers`).
LEFTOVER_GRACE_S = 1.0
LEFTOVER_CANCEL_S = 2.0


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal drains the gateway before it stops.

    :param config: the uvicorn config; its app is the gateway (``app.state.gateway``).
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._drain: asyncio.Task[None] | None = None
        self._draining = False  # the first signal came
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reloads: set[asyncio.Task[None]] = set()

    @property
    def gateway(self) -> Any:
        """The gateway's state (``app.state.gateway`` of the config's app)."""
        app: Any = self.config.app  # (uvicorn types it as any ASGI app, or a name)
        return app.state.gateway

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            self._loop.add_signal_handler(signal.SIGHUP, self._reload)
        try:
            await super().serve(sockets)
        finally:
            await _end_leftovers()

    async def shutdown(self, sockets: Any = None) -> None:
        """uvicorn's shutdown (the app's lifespan last), after ending any SIGHUP reload
        still under way, which would otherwise build backends after the app stopped."""
        await cancel_bounded(self._reloads, "SIGHUP reload", LEFTOVER_CANCEL_S)
        await super().shutdown(sockets)

    def _reload(self) -> None:
        """SIGHUP: read the configuration file again (see :func:`reload_config`)."""
        state = self.gateway

        async def reload() -> None:
            try:
                await reload_config(state)
            except GatewayError as exc:
                log.error("SIGHUP: %s", exc.message)

        self._reloads.add(task := asyncio.ensure_future(reload()))
        task.add_done_callback(self._reloads.discard)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: start the drain. A second one: cut what is in hand now (streams
        get their final error event), then stop."""
        if self._loop is None:
            super().handle_exit(sig, frame)
            return
        if not self._draining and not self.should_exit:
            self._draining = True
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        self._loop.call_soon_threadsafe(self._cut_now)

    def _cut_now(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.cancel()  # its finally cuts and stops
        else:
            self.should_exit = True

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        state = self.gateway
        log.info("draining: refusing new requests, finishing those in hand (up to %g s)",
                 state.settings.server.drain_timeout_s)
        try:
            finished = await state.drain()
            log.info("drain %s", "complete" if finished else "timed out; cutting the rest")
        finally:
            await _cut(state)
            self.should_exit = True

    @contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # a drained stop is a clean exit (status 0)


async def _end_leftovers() -> None:
    """After uvicorn's shutdown (the lifespan's included), every task the gateway
    started has been ended by its owner. One still running is a bug: it is logged with
    its name and stack, then cancelled, within :data:`LEFTOVER_GRACE_S` +
    :data:`LEFTOVER_CANCEL_S` seconds, so that the process's exit never waits on it
    for ever (``asyncio.run`` would, for a task that ignores its cancellation)."""
    found = await end_leftovers(grace_s=LEFTOVER_GRACE_S, cancel_s=LEFTOVER_CANCEL_S)
    if found:
        log.error("shutdown: %s", found.report())


def serve(app: Any, settings: Settings, *, host: str | None = None,
          port: int | None = None, config_path: str | None = None) -> None:
    """Serve ``app`` (built by :func:`gateway.http.app.create_app`) until a signal drains it.
    SIGHUP (and ``POST /admin/reload``) reads ``config_path`` again.

    :param host: overrides ``server.host``.
    :param port: overrides ``server.port``.
    :param config_path: the TOML file the settings came from, if any.
    """
    # The one part of the state set after create_app: the factory takes settings, not
    # where they came from (its signature is the tests' and the benchmarks').
    app.state.gateway.config_path = config_path
    server = settings.server
    _raise_fd_limit(open_files_needed(server.max_connections))
    addresses = listen_hosts(host or server.host)
    warn_if_open(settings, host or server.host)
    port = port if port is not None else server.port
    config = uvicorn.Config(
        app, host=addresses[0], port=port, log_level=server.log_level, loop="uvloop",
        log_config=None, access_log=False, **uvicorn_options(settings))
    if len(addresses) == 1:
        DrainingServer(config).run()
        return
    sockets = [_listening_socket(a, port, server.max_connections, inherit=False)
               for a in addresses]
    log.info("listening on %s, port %d", ", ".join(addresses), port)
    try:
        DrainingServer(config).run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()


def listen_hosts(host: str) -> list[str]:
    """The addresses of ``server.host``: one, or several separated by commas as
    llama-server's ``--host`` takes them (``"127.0.0.1,::1"``), each bound on the same
    port. Brackets around an IPv6 address are dropped.

    :raises ValueError: an empty address in the list.
    """
    parts = [part.strip().strip("[]") for part in host.split(",")]
    if not all(parts):
        raise ValueError(f"server.host {host!r} has an empty address")
    return parts


def serve_workers(settings: Settings, workers: int, *, host: str, port: int,
                  config_path: str | None) -> int:
    """Serve on one port with ``workers`` processes (``gateway serve --workers N``), which
    share one admission budget per backend through ``[state] backend = "redis"``.

    The parent binds the port and starts each worker with the socket (``spawn``, so that
    nothing of the parent's event loop is inherited); each builds its own app from
    ``config_path`` and serves with :class:`DrainingServer`, so SIGTERM drains every
    worker, a second one cuts, and SIGHUP reloads each. A worker that dies while no
    signal came is started again after a second. uvicorn's own ``--workers`` supervisor is
    not used because it builds a plain ``uvicorn.Server`` in each child, without the
    drain, and pickles the config, whose guarded h11 protocol class is built at run time.

    Counters and histograms of every worker are summed on each scrape (prometheus_client's
    multiprocess mode: ``PROMETHEUS_MULTIPROC_DIR`` is a directory the parent creates and
    removes); the capacity gauges are read from the shared state, the same in every
    worker.

    :returns: the exit status: 0 after a signal, once every worker has stopped.
    :raises ValueError: ``workers`` < 2, or the state is not shared.
    """
    if workers < 2:
        raise ValueError("serve_workers needs at least 2 workers")
    if settings.state.backend.value != "redis":
        raise ValueError('--workers needs [state] backend = "redis"')
    socks = [_listening_socket(a, port, settings.server.max_connections)
             for a in listen_hosts(host)]
    metrics_dir = tempfile.mkdtemp(prefix="gateway-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    ctx = multiprocessing.get_context("spawn")
    signals: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda sig, _frame: signals.append(sig))

    def start(index: int) -> multiprocessing.process.BaseProcess:
        proc = ctx.Process(target=_worker_main, args=(config_path, host, port, socks, index),
                           name=f"gateway-worker-{index}")
        proc.start()
        return proc

    procs = [start(i) for i in range(workers)]
    log.info("serving on %s:%d with %d workers (pids %s)", host, port, workers,
             ", ".join(str(p.pid) for p in procs))
    try:
        _supervise(procs, start, signals)
    finally:
        for sock in socks:
            sock.close()
        for name in os.listdir(metrics_dir):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(metrics_dir, name))
        with contextlib.suppress(OSError):
            os.rmdir(metrics_dir)
    return 0


def _listening_socket(host: str, port: int, backlog: int, *,
                      inherit: bool = True) -> socket.socket:
    """A socket bound to ``host:port`` and listening, that the workers inherit (unless
    ``inherit`` is false). An IPv6 socket takes IPv6 only, so that ``::`` beside
    ``0.0.0.0`` binds both, as llama-server's list of hosts does."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.set_inheritable(inherit)
    return sock


def _supervise(procs: list[multiprocessing.process.BaseProcess],
               start: Callable[[int], multiprocessing.process.BaseProcess],
               signals: list[int]) -> None:
    """Pass each signal received (``signals``, appended by the handlers) on to every
    worker; start again a worker that died while no stopping signal came. Returns once a
    signal other than SIGHUP came and every worker has stopped."""
    stopping = False
    while any(p.is_alive() for p in procs) or not stopping:
        while signals:
            sig = signals.pop(0)
            stopping = stopping or sig != signal.SIGHUP
            for proc in procs:
                if proc.is_alive() and proc.pid is not None:
                    os.kill(proc.pid, sig)
        for i, proc in enumerate(procs):
            if not stopping and not proc.is_alive():
                log.error("worker %d (pid %s) exited with status %s; starting it again",
                          i, proc.pid, proc.exitcode)
                time.sleep(1.0)
                procs[i] = start(i)
        time.sleep(0.2)


def _worker_main(config_path: str | None, host: str, port: int,
                 socks: list[socket.socket], index: int) -> None:
    """One worker of :func:`serve_workers`: its own settings, app and server."""
    from gateway.config import load_settings
    from gateway.http.app import create_app
    from gateway.observe.logs import configure_logging

    settings = load_settings(config_path)
    configure_logging(settings.server)
    app = create_app(settings)
    app.state.gateway.config_path = config_path
    server = settings.server
    _raise_fd_limit(open_files_needed(server.max_connections))  # each worker its own
    config = uvicorn.Config(
        app, host=host, port=port, log_level=server.log_level, loop="uvloop",
        log_config=None, access_log=False, **uvicorn_options(settings))
    DrainingServer(config).run(sockets=socks)


def warn_if_open(settings: Settings, host: str) -> bool:
    """Log a warning when the gateway has no tenant (anyone may use it) and listens
    beyond loopback; returns whether it did."""
    if settings.tenants or all(_loopback(a) for a in listen_hosts(host)):
        return False
    log.warning("no [[tenants]] configured and listening on %s: anyone who can reach this "
                "port may use every backend (docs/tenants.md)", host)
    return True


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


async def _cut(state: Any, grace_s: float = 2.0) -> None:
    """Cut the requests still in hand (:attr:`GatewayState.cut`) and give them up to
    ``grace_s`` seconds to send their final error events and release their leases."""
    state.cut.set()
    for _ in range(round(grace_s / 0.05)):
        if not any(s.inflight - s.abandoned_held for _, s, _r in state.fleet.stats()):
            return
        await asyncio.sleep(0.05)


def _raise_fd_limit(wanted: int) -> None:
    """Raise the soft limit on open files towards ``wanted`` (at most the hard limit),
    :func:`gateway.config.open_files_needed` of ``server.max_connections``: each request
    in hand holds its client connection and an upstream one, and as many more client
    connections may be open without a request. When ``server.max_connections`` is unset
    it was sized from this hard limit, so it fits. Logs a warning when the hard limit is
    lower than ``wanted``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit to %d: %s", target, exc)
    if target < wanted:
        log.warning("the open-file limit (%d) is below what server.max_connections "
                    "needs (%d); lower max_connections or raise the limit", target, wanted)
