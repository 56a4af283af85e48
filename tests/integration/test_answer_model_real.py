"""A real llama-server (Gemma 3 270M, started without ``--alias``) writes its model
file's path into every answer's ``model``; through the gateway, ``model`` is never a
path, whole or streamed, on every generation route (routing.answer_model): it is the name
the client asked for, else the file's name. And ``gateway serve --backend URL``, no file,
fronts it in one line, its kind asked of the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer, free_port
from tests.integration.conftest import GatewayThread

pytestmark = pytest.mark.llama

NO_REPACK = "--no-repack"  # this build's repacked kernels crash at start on AMX CPUs
ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Say hi."}],
                             "max_tokens": 3},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 3},
    "/completion": {"prompt": "Hello", "n_predict": 3},
    "/v1/responses": {"input": "Say hi.", "max_output_tokens": 3},
    "/v1/messages": {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3},
}
CASES = [(path, stream) for path in ROUTES for stream in (False, True)]


@pytest.fixture(scope="module")
def server(llama_parts: tuple[Any, Any]) -> Iterator[LlamaServer]:
    binary, model = llama_parts
    with LlamaServer(["-c", "2048", NO_REPACK], binary=binary, model=model).running() as s:
        yield s


@pytest.fixture(scope="module")
def gateway(server: LlamaServer) -> Iterator[GatewayThread]:
    with GatewayThread({"url": server.url}) as gw:
        yield gw


def models_in(text: str) -> list[Any]:
    """Every value of a ``model`` member, at any depth, of a whole JSON answer or of the
    ``data:`` lines of a stream."""
    found: list[Any] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            found.extend(v for k, v in value.items() if k == "model")
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    if text.lstrip().startswith(("{", "[")):
        walk(json.loads(text))
    for line in text.splitlines():
        if line.startswith("data: {"):
            walk(json.loads(line[6:]))
    return found


def is_path(name: Any) -> bool:
    return isinstance(name, str) and ("/" in name or "\\" in name or name.endswith(".gguf"))


def test_llama_server_itself_answers_with_its_model_files_path(server: LlamaServer) -> None:
    # What the gateway hides: the server's own answers name the -m path.
    r = httpx.post(server.url + "/v1/chat/completions", json=ROUTES["/v1/chat/completions"],
                   timeout=120)
    assert r.status_code == 200 and all(is_path(m) for m in models_in(r.text))


@pytest.mark.parametrize("path,stream", CASES,
                         ids=[f"{p}{' stream' if s else ''}" for p, s in CASES])
def test_model_in_answers_is_never_a_path(
        server: LlamaServer, gateway: GatewayThread, path: str, stream: bool) -> None:
    served = server.model.name.removesuffix(".gguf")  # the file's name, without .gguf
    for asked, expected in ((None, served), ("my-gemma", "my-gemma")):
        body = {**ROUTES[path], **({"stream": True} if stream else {})}
        if asked is not None:
            body["model"] = asked
        r = httpx.post(gateway.url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        models = models_in(r.text)
        assert models, r.text  # every one of these routes names the model somewhere
        assert set(models) == {expected}, (path, stream, models)
        assert str(server.model) not in r.text


def test_answer_model_backend_keeps_llama_servers_own_value(server: LlamaServer) -> None:
    with GatewayThread({"url": server.url}, routing={"answer_model": "backend"}) as gw:
        r = httpx.post(gw.url + "/v1/chat/completions",
                       json={**ROUTES["/v1/chat/completions"], "model": "my-gemma"},
                       timeout=120)
    assert r.status_code == 200 and set(models_in(r.text)) == {str(server.model)}


def test_gateway_serve_backend_url_fronts_it_in_one_line(server: LlamaServer) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--backend", server.url, "--port",
         str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                       json={**ROUTES["/v1/chat/completions"], "stream": True}, timeout=120)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        assert not any(is_path(m) for m in models_in(r.text))
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "is llama.cpp (detected" in err
