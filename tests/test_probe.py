"""gateway probe against faithful fakes of Ollama and vLLM (neither can run here) and the
fake llama-server. Shapes follow shared/design/backends.md §2 (Ollama v0.33 api/types.go)
and §3 (vLLM /v1/models and /metrics)."""

from __future__ import annotations

import tomllib

import httpx

from gateway.config import load_settings
from gateway.planner.probe import probe, render_probe
from tests.fake_vllm import FakeVllm
from tests.fakes import FakeLlamaServer

OLLAMA_PS = {"models": [{
    "name": "qwen3:8b", "model": "qwen3:8b", "size": 6_000_000_000, "digest": "abc",
    "details": {"family": "qwen3"}, "expires_at": "2026-11-29T12:00:00Z",
    "size_vram": 6_000_000_000, "context_length": 4096,
}]}
OLLAMA_SHOW = {"model_info": {"general.architecture": "qwen3", "qwen3.context_length": 40960,
                              "qwen3.block_count": 36}, "parameters": "", "capabilities": []}
VLLM_MODELS = {"object": "list", "data": [{"id": "meta-llama/Llama-3.1-8B", "object": "model",
                                           "owned_by": "vllm", "max_model_len": 8192}]}
VLLM_METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",gpu_memory_utilization="0.9",num_gpu_blocks="1250"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/Llama-3.1-8B"} 0.0
"""


def client_for(handler: object) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler))  # type: ignore[arg-type]


def test_probe_ollama() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        routes = {"/api/version": {"version": "0.33.0"}, "/api/ps": OLLAMA_PS,
                  "/api/show": OLLAMA_SHOW}
        if request.url.path in routes:
            return httpx.Response(200, json=routes[request.url.path])
        return httpx.Response(404, text="404 page not found")

    found = probe("http://ollama:11434", client_for(handle))
    assert found["kind"] == "ollama" and found["ctx_per_slot"] == 4096
    assert found["loaded_models"][0]["declared_context"] == 40960
    text = render_probe(found)
    assert "OLLAMA_NUM_PARALLEL" in text and "ctx_per_slot = 4096" in text


def test_probe_vllm() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=VLLM_MODELS)
        if request.url.path == "/metrics":
            return httpx.Response(200, text=VLLM_METRICS)
        return httpx.Response(404, json={"detail": "Not Found"})

    found = probe("http://vllm:8000", client_for(handle))
    assert found["kind"] == "vllm" and found["max_model_len"] == 8192
    assert (found["block_size"], found["num_gpu_blocks"], found["pool_tokens"]) == (16, 1250, 20000)
    assert "--max-num-seqs" in render_probe(found)
    block = tomllib.loads(found["backend_block"])["backends"][0]
    settings = load_settings(backends=[block])  # a block the gateway accepts
    assert (settings.backends[0].kind, settings.backends[0].slots) == ("vllm", 256)


def test_probe_newer_vllm_reads_the_pool_label_from_the_recorded_metrics() -> None:
    metrics = FakeVllm(num_gpu_blocks=900, block_size=16).metrics_text()

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=VLLM_MODELS)
        if request.url.path == "/metrics":
            return httpx.Response(200, text=metrics)
        return httpx.Response(404, json={"detail": "Not Found"})

    found = probe("http://vllm:8000", client_for(handle))
    assert (found["kv_cache_size_tokens"], found["pool_tokens"]) == (14_400, 14_400)


def test_probe_llama_server_fake() -> None:
    fake = FakeLlamaServer(slots=3, n_ctx=2048)

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/props":
            return httpx.Response(200, json={"total_slots": 3, "default_generation_settings": {
                "n_ctx": 2048}, "model_path": "m.gguf"})
        if request.url.path == "/slots":
            return httpx.Response(200, json=[{"id": i, "n_ctx": 2048, "is_processing": i == 0}
                                             for i in range(3)])
        return httpx.Response(200, json={"data": [{"id": "m", "meta": {"n_ctx_train": 32768}}]})

    found = probe("http://llama:8080/", client_for(handle))
    assert (found["kind"], found["slots"], found["ctx_per_slot"]) == ("llama.cpp", 3, 2048)
    assert found["busy_slots"] == 1 and found["n_ctx_train"] == 32768
    text = render_probe(found)
    assert "kv_unified" in text and "pool_tokens" in text and 'url = "http://llama:8080"' in text
    assert fake.slots == 3


def test_probe_unreachable() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    found = probe("http://nowhere:1", client_for(handle))
    assert found["kind"] == "unknown" and "cannot reach" in found["error"]
