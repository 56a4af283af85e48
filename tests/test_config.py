"""TOML loading, env overrides, validation messages and the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.__main__ import main
from gateway.config import ConfigError, load_settings

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "gateway.toml"
    p.write_text(text)
    return p


def test_example_config_loads_with_documented_defaults() -> None:
    s = load_settings(ROOT / "config.example.toml")
    assert s.server.port == 8000 and s.server.max_body_bytes == 10485760
    assert s.admission.max_queue == 64 and s.admission.max_queue_wait_s == 30.0
    assert s.admission.default_max_tokens is None and s.admission.overlong.value == "reject"
    assert s.admission.policy.value == "strict" and s.admission.predict_quantile == 0.95
    b = s.backends[0]
    assert (b.name, b.url, b.kind.value, b.kv_unified) == (
        "local", "http://127.0.0.1:8080", "llama.cpp", True)
    assert b.slots is None and b.ctx_per_slot is None and b.pool_tokens is None


def test_example_config_documents_every_key() -> None:
    from gateway.config import (
        AdmissionSettings,
        BackendSettings,
        ClassSettings,
        RoutingSettings,
        ServerSettings,
        StateSettings,
        TenantSettings,
    )

    text = (ROOT / "config.example.toml").read_text()
    for model in (ServerSettings, AdmissionSettings, RoutingSettings, BackendSettings,
                  ClassSettings, TenantSettings, StateSettings):
        for key in model.model_fields:
            assert f"{key} =" in text, key


def test_env_overrides_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write(tmp_path, "[admission]\nmax_queue = 3\n[[backends]]\nname = 'a'\n")
    monkeypatch.setenv("GATEWAY_ADMISSION__MAX_QUEUE", "9")
    monkeypatch.setenv("GATEWAY_SERVER__PORT", "9100")
    s = load_settings(p)
    assert s.admission.max_queue == 9 and s.server.port == 9100 and s.backends[0].name == "a"


@pytest.mark.parametrize("text,needle", [
    ("[admission]\nmax_qeue = 3\n", "admission.max_qeue: unknown key"),
    ("bogus = 1\n", "bogus: unknown key"),
    ("[[backends]]\nname = 'a'\nslotz = 2\n", "backends.0.slotz: unknown key"),
    ("[admission]\nmax_queue = -1\n", "admission.max_queue"),
    ("[admission]\noverlong = 'truncate'\n", "admission.overlong"),
    ("[[backends]]\nname = 'a'\nurl = 'localhost:8080'\n", "http://"),
    ("[[backends]]\nname = 'a'\n[[backends]]\nname = 'a'\n", "repeated: a"),
    ("[[backends]]\nname = 'a'\nkv_unified = false\npool_tokens = 4096\n", "pool_tokens"),
    ("[[backends]]\nname = 'a'\nkind = 'vllm'\nkv_unified = false\n", "contradicts"),
    ("[[backends]]\nname = 'a'\nkind = 'ollama'\nkv_unified = true\n", "contradicts"),
    ("[[backends]]\nname = 'a'\nkind = 'ollama'\npool_tokens = 4096\n", "own context"),
    ("[[backends]]\nname = 'a'\nurl = 'http://h:8080/v1/'\n", "without /v1"),
    ("[server]\nlog_level = 'verbose'\n", "log_level"),
    ("[server\n", "not valid TOML"),
])
def test_bad_config_names_the_key(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(write(tmp_path, text))
    assert needle in str(info.value)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings("/nonexistent/gateway.toml")


def test_check_config_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(ROOT / "config.example.toml")]) == 0
    assert '"default_max_tokens": null' in capsys.readouterr().out
    assert main(["check-config", str(write(tmp_path, "nope = 1\n"))]) == 2
    assert "nope: unknown key" in capsys.readouterr().err


@pytest.mark.parametrize("extra,needle", [
    ("", "the pool is taken to be one slot's context"),
    ("slots = 4\nctx_per_slot = 512\npool_tokens = 2048\n", "it cannot overflow"),
    ("slots = 4\nctx_per_slot = 2048\npool_tokens = 4096\n", "share a pool of 4096"),
])
def test_check_config_explains_the_unified_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: str, needle: str
) -> None:
    path = write(tmp_path, f'[[backends]]\nname = "a"\n{extra}')
    assert main(["check-config", str(path)]) == 0
    assert needle in capsys.readouterr().err


def test_check_config_prints_the_effective_kv_unified(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    path = write(tmp_path, "[[backends]]\nname = 'a'\n[[backends]]\nname = 'v'\n"
                           "kind = 'vllm'\nurl = 'http://127.0.0.1:8001'\n")
    assert main(["check-config", str(path)]) == 0
    llama, vllm = json.loads(capsys.readouterr().out)["backends"]
    assert llama["kv_unified"] is True and "kv_unified" not in vllm


def test_configs_that_describe_the_real_layout_still_load(tmp_path: Path) -> None:
    text = ("[server]\nlog_level = 'INFO'\n[[backends]]\nname = 'v'\nkind = 'vllm'\n"
            "kv_unified = true\n[[backends]]\nname = 'o'\nkind = 'ollama'\n"
            "kv_unified = false\n")
    s = load_settings(write(tmp_path, text))
    assert s.server.log_level == "info" and [b.kv_unified for b in s.backends] == [True, False]


def test_python_dash_m_gateway_runs() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(ROOT / "config.example.toml")],
        capture_output=True, text=True, check=True,
    )
    assert '"max_queue": 64' in out.stdout


def test_a_misspelled_section_in_an_environment_override_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The fresh-user pass: GATEWAY_ADMISSON__MAX_QUEUE=8 was ignored without a word,
    where a misspelled key in a known section is refused."""
    monkeypatch.setenv("GATEWAY_ADMISSON__MAX_QUEUE", "8")
    with pytest.raises(ConfigError, match="GATEWAY_ADMISSON__MAX_QUEUE: unknown section "
                                          "'admisson'"):
        load_settings()
    monkeypatch.delenv("GATEWAY_ADMISSON__MAX_QUEUE")
    monkeypatch.setenv("GATEWAY_ADMISSION__MAX_QUEUE", "8")
    monkeypatch.setenv("GATEWAY_MODEL", "/nowhere.gguf")  # make run's, not a setting
    assert load_settings().admission.max_queue == 8


def test_a_value_the_message_already_shows_is_not_shown_twice() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(backends=[{"name": "a", "url": "127.0.0.1:8080"}])
    assert str(caught.value).count("'127.0.0.1:8080'") == 1, str(caught.value)
