"""``gateway serve --backend URL`` and ``gateway check-config --backend URL --print``: the
backends of the command line, their kind asked of the server when not given, bad input
refused with a message naming the argument and exit status 2, and the TOML the settings
amount to loading back to the same settings."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gateway.__main__ import main
from gateway.config import ConfigError, backends_from_args, load_settings

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def server() -> Iterator[Any]:
    """A real HTTP server on a free loopback port answering the discovery routes of
    whichever kind ``server.kind`` names: llama-server's ``/props``, Ollama's
    ``/api/version``, vLLM's ``/v1/models`` (``owned_by: "vllm"``); 404 otherwise."""
    answers = {
        "llama.cpp": {"/props": {"total_slots": 4,
                                 "default_generation_settings": {"n_ctx": 2048}}},
        "ollama": {"/api/version": {"version": "0.12.0"}, "/api/ps": {"models": []}},
        "vllm": {"/v1/models": {"object": "list", "data": [
            {"id": "Qwen/Qwen3-0.6B", "owned_by": "vllm", "max_model_len": 4096}]}},
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
            body = answers[httpd.kind].get(self.path.split("?")[0])
            if body is None and self.path == "/health":
                body = {"status": "ok"}
            data = json.dumps(body).encode()
            self.send_response(200 if body is not None else 404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args: Any) -> None:
            pass

    httpd: Any = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.kind = "llama.cpp"
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def test_an_argument_gives_its_url_and_any_keys_in_any_order() -> None:
    assert backends_from_args(["http://127.0.0.1:8080"]) == [
        {"name": "127.0.0.1:8080", "url": "http://127.0.0.1:8080"}]
    assert backends_from_args(["kind=ollama, name=o,url=http://h:11434/"]) == [
        {"kind": "ollama", "name": "o", "url": "http://h:11434/"}]
    two = backends_from_args(["http://h:8080", "http://h:8080/b,kind=vllm,slots=8"])
    assert [b["name"] for b in two] == ["h:8080", "h:8080-2"]
    assert two[1]["slots"] == "8"  # typed when the settings load


@pytest.mark.parametrize("arg,needle", [
    ("localhost:8080", "is neither the server's URL"),
    ("http://h:8080,kind=llamacpp", "unknown kind 'llamacpp' (one of llama.cpp, ollama, vllm"),
    ("http://h:8080,colour=red", "unknown key 'colour'"),
    ("http://h:8080,api_key=sk-1", "give api_key_file=PATH"),
    ("http://h:8080,name=a,name=b", "name is given twice"),
    ("kind=ollama", "no URL"),
    ("http://h:8080/v1", "url: is the server's base URL, without /v1"),
    ("http://h:8080,slots=zero", "slots: Input should be a valid integer"),
    ("http://", "url: names no host"),
    ("http://:8080", "url: names no host"),
    ("http://h:99999", "url: has no valid port"),
    ("http://h:8080?x=1", "url: is the server's base URL, without a query"),
    ("http://h:8080/#top", "url: is the server's base URL, without a query"),
    ("http://h:8080,kind=ollama,kv_unified=true", "contradicts a ollama backend"),
])
def test_a_bad_argument_is_refused_naming_it(arg: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        backends_from_args([arg])
    assert needle in str(info.value) and repr(arg) in str(info.value)


@pytest.mark.parametrize("command", ["serve", "check-config"])
@pytest.mark.parametrize("arg,needle", [
    ("localhost:8080", "is neither the server's URL"),
    ("http://127.0.0.1:9,kind=foo", "unknown kind 'foo'"),
])
def test_bad_input_exits_2_with_its_reason(
        capsys: pytest.CaptureFixture[str], command: str, arg: str, needle: str) -> None:
    assert main([command, "--backend", arg]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gateway: --backend") and needle in err


def test_a_server_that_cannot_be_reached_cannot_have_its_kind_told(
        capsys: pytest.CaptureFixture[str], server: Any) -> None:
    url = server.url
    server.shutdown()
    server.server_close()
    assert main(["check-config", "--backend", url]) == 2
    err = capsys.readouterr().err
    assert f"--backend {url}: the kind of server cannot be told: cannot reach" in err
    assert "give kind=llama.cpp" in err


def test_gateway_backends_and_backend_together_are_refused(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_BACKENDS", '[{"name": "a"}]')
    assert main(["check-config", "--backend", "http://h:1,kind=vllm"]) == 2
    assert "both list the backends" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["llama.cpp", "ollama", "vllm"])
def test_the_kind_is_asked_of_the_server(
        capsys: pytest.CaptureFixture[str], server: Any, kind: str) -> None:
    server.kind = kind
    assert main(["check-config", "--backend", server.url, "--print"]) == 0
    out, err = capsys.readouterr()
    (backend,) = _load(out).backends
    assert backend.kind.value == kind and backend.url == server.url
    assert f"is {kind} (detected" in err


def _load(text: str, tmp: Path | None = None) -> Any:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(tmp or d) / "printed.toml"
        path.write_text(text)
        return load_settings(path)


def test_print_amounts_to_the_same_settings(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('[server]\nport = 9001\ncors_origins = ["*"]\n[admission]\n'
                      'policy = "predictive"\n[routing]\nanswer_model = "backend"\n'
                      '[[backends]]\nname = "a"\nslots = 2\n')
    assert main(["check-config", str(config), "--backend", "http://h:8080,kind=llama.cpp,"
                 "kv_unified=false", "--backend", "http://h:11434,kind=ollama,name=o",
                 "--print"]) == 0
    out = capsys.readouterr().out
    printed = _load(out, tmp_path)
    expected = load_settings(config, backends=[
        {"name": "h:8080", "url": "http://h:8080", "kind": "llama.cpp", "kv_unified": False},
        {"name": "o", "url": "http://h:11434", "kind": "ollama"}])
    assert printed == expected
    assert "max_connections" not in out  # defaults (here, one sized from the machine) left out
    assert [b.name for b in printed.backends] == ["h:8080", "o"]  # the file's were replaced


def test_print_leaves_secrets_out_and_says_so(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    config = tmp_path / "gateway.toml"
    config.write_text('[server]\nadmin_key = "sk-admin"\n[state]\n'
                      'redis_url = "redis://:pw@127.0.0.1:6379/0"\n'
                      '[[backends]]\nname = "a"\napi_key = "sk-inline"\n'
                      f'[[backends]]\nname = "b"\nurl = "http://h:1"\napi_key_file = "{key_file}"\n')
    assert main(["check-config", str(config), "--print"]) == 0
    out, err = capsys.readouterr()
    for secret in ("sk-admin", "sk-inline", "sk-from-file", ":pw@"):
        assert secret not in out
    assert str(key_file) in out and "redis://:***@127.0.0.1:6379/0" in out
    assert "server.admin_key is set and not printed" in err
    assert "backends[0].api_key is set and not printed" in err
    assert "state.redis_url holds a password" in err


def test_a_password_in_a_backend_url_is_never_printed(
        capsys: pytest.CaptureFixture[str]) -> None:
    # http://user:PW@host is sent as HTTP Basic (httpx reads a URL's userinfo).
    arg = "http://user:s3cret@h:8080,kind=llama.cpp"
    assert main(["check-config", "--backend", arg, "--print"]) == 0
    out, err = capsys.readouterr()
    assert "s3cret" not in out and 'url = "http://user:***@h:8080"' in out
    assert "backends[0].url holds a password" in err
    assert main(["check-config", "--backend", arg]) == 0
    out, _ = capsys.readouterr()
    assert "s3cret" not in out
    assert json.loads(out)["backends"][0]["url"] == "http://user:***@h:8080"
    assert main(["check-config", "--backend", arg, "--backend",
                 "http://user:s3cret@h:8080,kind=vllm"]) == 2  # the same server twice
    assert "s3cret" not in capsys.readouterr().err


def test_check_config_without_a_file_or_backend_prints_the_defaults_as_json(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config"]) == 0
    assert json.loads(capsys.readouterr().out)["backends"][0]["name"] == "local"


def test_serve_runs_with_the_backends_of_the_command_line(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        server: Any) -> None:
    import gateway.http.serving
    import gateway.observe.logs

    served: dict[str, Any] = {}

    def serve(app: Any, settings: Any, **kw: Any) -> None:
        served.update(settings=settings, **kw)

    monkeypatch.setattr(gateway.http.serving, "serve", serve)
    monkeypatch.setattr(gateway.observe.logs, "configure_logging", lambda server: None)
    monkeypatch.delenv("GATEWAY_BACKENDS", raising=False)  # restored after the test
    server.kind = "ollama"
    assert main(["serve", "--backend", server.url, "--port", "0"]) == 0
    (backend,) = served["settings"].backends
    assert (backend.name, backend.url, backend.kind.value) == (
        f"127.0.0.1:{server.server_address[1]}", server.url, "ollama")
    # Workers and a reload read the same backends again, from the environment.
    import os

    assert json.loads(os.environ["GATEWAY_BACKENDS"])[0]["kind"] == "ollama"
    assert load_settings().backends == served["settings"].backends
