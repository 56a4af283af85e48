"""Tenants through the whole app, over the fake llama-server (tests/fakes.py): keys and
401s, admin and /metrics keys, priority classes, fair order between tenants, shedding,
quotas and their 429s, labels, and keys kept out of the logs."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from gateway.config import ConfigError, load_settings
from gateway.fleet.reload import reload
from gateway.http.app import create_app
from tests.conftest import Harness
from tests.fakes import FakeLlamaServer, ManualClock

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
WEB_KEY, BATCH_KEY, ADMIN_KEY = "sk-web-0123456789", "sk-batch-abcdef", "admin-secret-42"
CANARY = "zebra-canary-prompt-text"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


TENANTS = [
    {"name": "web", "key_hashes": [digest(WEB_KEY)], "priority": "interactive"},
    {"name": "batch", "key_hashes": [f"sha256:{digest(BATCH_KEY)}"], "priority": "batch"},
]
CLASSES = [{"name": "interactive"}, {"name": "batch", "max_queue_wait_s": 600}]


@pytest.fixture
async def make(fake: FakeLlamaServer) -> AsyncIterator[Callable[..., Any]]:
    made: list[Harness] = []

    async def build(*, tenants: list[dict[str, Any]] | None = None, clock: Any = None,
                    server: dict[str, Any] | None = None, admission: dict[str, Any] | None
                    = None, **backend: Any) -> Harness:
        settings = load_settings(
            server=server or {}, admission={"disconnect_grace_s": 0.0, **(admission or {})},
            backends=[{"name": "local", "url": "http://upstream:8080", **backend}],
            classes=CLASSES, tenants=TENANTS if tenants is None else tenants)
        app = create_app(settings, http_client=fake.client(), registry=CollectorRegistry(),
                         clock=clock, discover=False)
        h = Harness(app, fake)
        await h.backend.discover()
        made.append(h)
        return h

    yield build
    for h in made:
        await h.client.aclose()


def chat_body(content: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 20, **extra}


def post(h: Harness, key: str, content: str = "hello there", **extra: Any
         ) -> asyncio.Future[httpx.Response]:
    """Send a chat with tenant ``key`` in the background."""
    return asyncio.ensure_future(h.client.post(CHAT, json=chat_body(content, **extra),
                                               headers=bearer(key)))


async def until(check: Callable[[], bool]) -> None:
    """Wait (polling) until ``check()`` holds."""
    while not check():
        await asyncio.sleep(0.01)


# -- authentication ---------------------------------------------------------------------

@pytest.mark.parametrize("headers", [
    {}, bearer("sk-wrong"), {"authorization": WEB_KEY}, {"authorization": f"Basic {WEB_KEY}"},
    {"authorization": "Bearer "}, {"x-api-key": "sk-wrong"},
], ids=["none", "wrong", "no-scheme", "basic", "empty", "wrong-x-api-key"])
async def test_requests_without_a_valid_key_get_401_and_reach_nothing(
        make: Any, fake: FakeLlamaServer, headers: dict[str, str]) -> None:
    h = await make()
    upstream_before = len(fake.requests)
    r = await h.client.post(CHAT, json=chat_body(), headers=headers)
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    assert len(fake.requests) == upstream_before  # not counted, not forwarded
    assert h.sample("gateway_rejections_total", reason="unauthorized") == 1
    assert h.sample("gateway_requests_total", code="401", tenant="none") == 1


async def test_a_401_is_shaped_for_each_api(make: Any) -> None:
    h = await make()
    r = await h.client.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.json()["type"] == "error"  # Anthropic's shape
    r = await h.client.post("/api/chat", json={"model": "m", "messages": []})
    assert r.status_code == 401 and isinstance(r.json()["error"], str)  # Ollama's
    r = await h.client.get("/v1/models")
    assert r.status_code == 401


async def test_valid_keys_in_either_header_are_served(make: Any, fake: FakeLlamaServer
                                                      ) -> None:
    h = await make()
    r = await h.client.post(CHAT, json=chat_body(), headers=bearer(WEB_KEY))
    assert r.status_code == 200
    r = await h.client.post(CHAT, json=chat_body(), headers={"x-api-key": BATCH_KEY})
    assert r.status_code == 200
    sent = [req for req in fake.requests if req.url.path == CHAT]
    assert sent and all("authorization" not in req.headers for req in sent)
    assert h.sample("gateway_requests_total", code="200", tenant="web",
                    priority="interactive") == 1
    assert h.sample("gateway_requests_total", code="200", tenant="batch",
                    priority="batch") == 1


async def test_the_backend_key_goes_upstream_not_the_clients(make: Any, fake: FakeLlamaServer
                                                             ) -> None:
    fake.api_key = "upstream-key"
    h = await make(api_key="upstream-key")
    r = await h.client.post(CHAT, json=chat_body(), headers=bearer(WEB_KEY))
    assert r.status_code == 200
    sent = [req for req in fake.requests if req.url.path == CHAT][-1]
    assert sent.headers["authorization"] == "Bearer upstream-key"


async def test_probes_stay_open_and_metrics_follow_the_admin_key(make: Any) -> None:
    h = await make(server={"admin_key": ADMIN_KEY})
    assert (await h.client.get("/health")).status_code == 200
    assert (await h.client.get("/ready")).status_code == 200
    assert (await h.client.get("/metrics")).status_code == 401
    assert (await h.client.get("/metrics", headers=bearer(WEB_KEY))).status_code == 401
    assert (await h.client.get("/metrics", headers=bearer(ADMIN_KEY))).status_code == 200
    assert (await h.client.get("/admin/backends", headers=bearer(WEB_KEY))).status_code == 401
    assert (await h.client.get("/admin/backends",
                               headers=bearer(ADMIN_KEY))).status_code == 200
    public = await make(server={"admin_key": ADMIN_KEY, "metrics_public": True})
    assert (await public.client.get("/metrics")).status_code == 200
    keyless = await make()
    assert (await keyless.client.get("/metrics")).status_code == 200


async def test_an_open_gateway_serves_anyone_as_anonymous(make: Any) -> None:
    h = await make(tenants=[])
    r = await h.client.post(CHAT, json=chat_body())
    assert r.status_code == 200
    assert h.sample("gateway_requests_total", code="200", tenant="anonymous",
                    priority="interactive") == 1


async def test_the_openai_sdk_works_with_a_key(make: Any) -> None:
    h = await make()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=h.app), base_url="http://g")
    good = openai.AsyncOpenAI(base_url="http://g/v1", api_key=WEB_KEY, http_client=http,
                              max_retries=0)
    out = await good.chat.completions.create(
        model="local", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert out.choices[0].message.content
    bad = openai.AsyncOpenAI(base_url="http://g/v1", api_key="sk-nope", http_client=http,
                             max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        await bad.chat.completions.create(
            model="local", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert info.value.code == "invalid_api_key"
    await http.aclose()


async def test_keys_and_prompts_stay_out_of_the_logs(make: Any, fake: FakeLlamaServer,
                                                     caplog: pytest.LogCaptureFixture
                                                     ) -> None:
    caplog.set_level(logging.DEBUG)
    h = await make(server={"admin_key": ADMIN_KEY})
    body = chat_body(CANARY)
    for headers in ({}, bearer("sk-wrong-key-777"), {"authorization": WEB_KEY},
                    bearer(WEB_KEY), {"x-api-key": BATCH_KEY}):
        await h.client.post(CHAT, json=body, headers=headers)
    await h.client.post(CHAT, json={**body, "priority": "nope"}, headers=bearer(WEB_KEY))
    await h.client.post(CHAT, json=body, headers={**bearer(BATCH_KEY),
                                                  "x-priority": "interactive"})
    fake.mode = "boom"
    await h.client.post(CHAT, json=body, headers=bearer(WEB_KEY))
    fake.mode = "connect"
    await h.client.post(CHAT, json=body, headers=bearer(WEB_KEY))
    await h.client.get("/metrics", headers=bearer("admin-wrong"))
    await h.client.get("/admin/backends", headers=bearer(ADMIN_KEY))
    text = caplog.text
    assert text  # something was logged on these paths
    for secret in (WEB_KEY, BATCH_KEY, ADMIN_KEY, "sk-wrong-key-777", "admin-wrong", CANARY):
        assert secret not in text


# -- priority classes --------------------------------------------------------------------

async def test_a_request_may_ask_a_lower_class_never_a_higher_one(
        make: Any, fake: FakeLlamaServer) -> None:
    h = await make()
    r = await h.client.post(CHAT, json=chat_body(), headers={**bearer(WEB_KEY),
                                                             "x-priority": "batch"})
    assert r.status_code == 200
    assert h.sample("gateway_requests_total", tenant="web", priority="batch") == 1
    r = await h.client.post(CHAT, json=chat_body(priority="batch"), headers=bearer(WEB_KEY))
    assert r.status_code == 200
    assert "priority" not in json.loads(fake.requests[-1].content)  # taken out of the body
    r = await h.client.post(CHAT, json=chat_body(priority="interactive"),
                            headers=bearer(BATCH_KEY))
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    r = await h.client.post(CHAT, json=chat_body(), headers={**bearer(WEB_KEY),
                                                             "x-priority": "gold"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    r = await h.client.post(CHAT, json=chat_body(priority=3), headers=bearer(WEB_KEY))
    assert r.status_code == 200
    assert json.loads(fake.requests[-1].content)["priority"] == 3  # vLLM's own field


async def test_tenants_of_one_class_alternate(make: Any, fake: FakeLlamaServer) -> None:
    fake.hold = asyncio.Event()
    tenants = [{**TENANTS[0]}, {**TENANTS[1], "priority": "interactive"}]
    h = await make(slots=1, tenants=tenants)
    first = post(h, BATCH_KEY, "running")
    await asyncio.sleep(0.05)
    tasks = [post(h, BATCH_KEY, f"b{i}") for i in range(4)]
    await until(lambda: h.backend.stats().queued >= 4)
    tasks += [post(h, WEB_KEY, f"w{i}") for i in range(2)]
    await until(lambda: h.backend.stats().queued >= 6)
    fake.hold.set()
    await asyncio.gather(first, *tasks)
    order = [g["messages"][0]["content"] for g in fake.generations][1:]
    assert order[:4] in (["b0", "w0", "b1", "w1"], ["w0", "b0", "w1", "b1"]), order


async def test_a_full_queue_sheds_batch_work_for_interactive(make: Any, fake: FakeLlamaServer
                                                             ) -> None:
    fake.hold = asyncio.Event()
    h = await make(slots=1, admission={"max_queue": 2, "reject_predicted_timeouts": False})
    running = post(h, BATCH_KEY, "run")
    await asyncio.sleep(0.05)
    waiting = [post(h, BATCH_KEY, f"b{i}") for i in range(2)]
    await until(lambda: h.backend.stats().queued >= 2)
    r = await h.client.post(CHAT, json=chat_body("more batch"), headers=bearer(BATCH_KEY))
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"  # no shed
    web = post(h, WEB_KEY, "web")
    shed = await waiting[1]  # the newest batch waiter makes room
    assert shed.status_code == 503 and shed.json()["error"]["code"] == "queue_full"
    assert "higher class" in shed.json()["error"]["message"] and shed.headers["retry-after"]
    assert h.sample("gateway_rejections_total", reason="shed", tenant="batch") == 1
    fake.hold.set()
    assert (await web).status_code == 200 and (await running).status_code == 200
    assert (await waiting[0]).status_code == 200


# -- quotas ------------------------------------------------------------------------------

async def test_tokens_per_minute_gives_429_with_openai_headers(make: Any) -> None:
    clock = ManualClock()
    tenants = [{**TENANTS[0], "tokens_per_minute": 40}, TENANTS[1]]
    h = await make(tenants=tenants, clock=clock)
    # The fake counts "hello there" as 2 words + 4 + 2 = 8 prompt tokens and answers 5:
    # 13 tokens a request.
    r = await h.client.post(CHAT, json=chat_body(), headers=bearer(WEB_KEY))
    assert r.status_code == 200
    assert r.headers["x-ratelimit-limit-tokens"] == "40"
    assert r.headers["x-ratelimit-remaining-tokens"] == "32"  # its prompt, held at arrival
    for _ in range(2):
        clock.advance(10)
        assert (await h.client.post(CHAT, json=chat_body(), headers=bearer(WEB_KEY))
                ).status_code == 200
    clock.advance(10)  # t = 30 s: 39 used; 8 more would pass 40
    r = await h.client.post(CHAT, json=chat_body(), headers=bearer(WEB_KEY))
    assert r.status_code == 429
    err = r.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and "tokens per minute" in err["message"]
    assert r.headers["x-ratelimit-limit-tokens"] == "40"
    assert r.headers["x-ratelimit-remaining-tokens"] == "1"
    assert r.headers["x-ratelimit-reset-tokens"] == "50s"  # when the window is empty
    # It may pass once the first request leaves the window.
    assert r.headers["retry-after"] == "30" and r.headers["retry-after-ms"] == "30000"
    assert h.sample("gateway_rejections_total", reason="tokens_per_minute",
                    tenant="web") == 1
    # The other tenant is not affected; the refused request counted nothing.
    assert (await h.client.post(CHAT, json=chat_body(), headers=bearer(BATCH_KEY))
            ).status_code == 200
    assert h.sample("gateway_tenant_tokens_total", tenant="web", kind="prompt") == 24
    assert h.sample("gateway_tenant_tokens_total", tenant="web", kind="completion") == 15
    clock.advance(30)  # the first request's 13 tokens leave the window
    assert (await h.client.post(CHAT, json=chat_body(), headers=bearer(WEB_KEY))
            ).status_code == 200


async def test_a_prompt_over_the_whole_minute_can_never_pass(make: Any) -> None:
    h = await make(tenants=[{**TENANTS[0], "tokens_per_minute": 5}])
    r = await h.client.post(CHAT, json=chat_body(), headers=bearer(WEB_KEY))
    assert r.status_code == 429 and "can never pass" in r.json()["error"]["message"]
    assert r.headers["x-should-retry"] == "false"  # SDKs must not wait to retry it
    assert "retry-after" not in r.headers


async def test_a_request_refused_after_its_hold_gives_its_tokens_back(
        make: Any, fake: FakeLlamaServer) -> None:
    fake.hold = asyncio.Event()
    clock = ManualClock()
    h = await make(slots=1, clock=clock, tenants=[{**TENANTS[0], "tokens_per_minute": 100}],
                   admission={"max_queue_wait_s": 5})
    running = post(h, WEB_KEY)
    await asyncio.sleep(0.05)
    waiting = post(h, WEB_KEY)
    await until(lambda: h.backend.stats().queued >= 1)
    clock.advance(6)
    assert (await waiting).status_code == 503  # queue_timeout: never forwarded
    fake.hold.set()
    assert (await running).status_code == 200
    r = await h.client.post(CHAT, json=chat_body(), headers=bearer(WEB_KEY))
    # 100 - 13 (the first: 8 prompt + 5 completion) - 8 (this one's prompt, held).
    assert r.headers["x-ratelimit-remaining-tokens"] == "79"


async def test_max_queued_refuses_one_more_waiting_request(make: Any, fake: FakeLlamaServer
                                                           ) -> None:
    fake.hold = asyncio.Event()
    h = await make(slots=1, tenants=[{**TENANTS[0], "max_queued": 1}, TENANTS[1]])
    running = post(h, WEB_KEY)
    await asyncio.sleep(0.05)
    queued = post(h, WEB_KEY)
    await until(lambda: h.backend.stats().queued >= 1)
    r = await h.client.post(CHAT, json=chat_body(), headers=bearer(WEB_KEY))
    assert r.status_code == 429 and "max_queued" in r.json()["error"]["message"]
    assert h.sample("gateway_rejections_total", reason="max_queued") == 1
    other = post(h, BATCH_KEY)
    await until(lambda: h.backend.stats().queued >= 2)  # another tenant still queues
    fake.hold.set()
    assert [x.status_code for x in await asyncio.gather(running, queued, other)] == [200] * 3


async def test_max_inflight_holds_a_tenant_at_its_gate_not_in_the_queue(
        make: Any, fake: FakeLlamaServer) -> None:
    fake.hold = asyncio.Event()
    h = await make(slots=2, tenants=[{**TENANTS[0], "max_inflight": 1}, TENANTS[1]])
    first = post(h, WEB_KEY, "w1")
    await asyncio.sleep(0.05)
    second = post(h, WEB_KEY, "w2")
    await asyncio.sleep(0.05)
    assert h.backend.stats().inflight == 1 and h.backend.stats().queued == 0
    tenant = h.state.tenants.by_name["web"]
    assert (tenant.inflight, tenant.waiting) == (1, 1)
    other = post(h, BATCH_KEY, "b1")
    await until(lambda: h.backend.stats().inflight >= 2)  # the free slot goes to the other tenant
    fake.hold.set()
    assert [x.status_code for x in await asyncio.gather(first, second, other)] == [200] * 3
    assert (tenant.inflight, tenant.waiting) == (0, 0)


async def test_a_gate_wait_past_the_class_limit_is_a_429(make: Any, fake: FakeLlamaServer
                                                         ) -> None:
    fake.hold = asyncio.Event()
    clock = ManualClock()
    h = await make(tenants=[{**TENANTS[0], "max_inflight": 1}], clock=clock,
                   admission={"max_queue_wait_s": 5})
    first = post(h, WEB_KEY)
    await asyncio.sleep(0.05)
    second = post(h, WEB_KEY)
    await asyncio.sleep(0.05)
    clock.advance(6)
    r = await second
    assert r.status_code == 429 and "max_inflight" in r.json()["error"]["message"]
    fake.hold.set()
    assert (await first).status_code == 200
    assert h.state.tenants.by_name["web"].inflight == 0


# -- configuration -----------------------------------------------------------------------

def test_plain_keys_are_refused_and_never_echoed() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(tenants=[{"name": "a", "key_hashes": ["sk-my-plain-secret"]}])
    assert "SHA-256" in str(info.value) and "sk-my-plain-secret" not in str(info.value)


def test_key_hashes_come_from_env_and_file(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("WEB_HASHES", f"{digest('k1')}, {digest('k2')}")
    keys = tmp_path / "web.keys"
    keys.write_text(f"# rotated 2026-11\n{digest('k3')}\n\n")
    settings = load_settings(tenants=[{"name": "web", "key_hashes_env": "WEB_HASHES",
                                       "key_hashes_file": str(keys)}])
    assert settings.tenants[0].key_hashes == [digest("k1"), digest("k2"), digest("k3")]
    with pytest.raises(ConfigError, match="not set"):
        load_settings(tenants=[{"name": "web", "key_hashes_env": "NO_SUCH_VAR_XYZ"}])
    with pytest.raises(ConfigError, match="no key"):
        load_settings(tenants=[{"name": "web"}])


def test_tenant_settings_are_checked_together() -> None:
    with pytest.raises(ConfigError, match="share a key"):
        load_settings(tenants=[{"name": "a", "key_hashes": [digest("k")]},
                               {"name": "b", "key_hashes": [digest("k")]}])
    with pytest.raises(ConfigError, match="not a class"):
        load_settings(tenants=[{"name": "a", "key_hashes": [digest("k")],
                                "priority": "gold"}])
    with pytest.raises(ConfigError, match="unique"):
        load_settings(classes=[{"name": "x"}, {"name": "x"}])


def test_hash_key_prints_the_sha256_of_stdin() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway", "hash-key"], input="my key\n",
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == digest("my key")
    made = subprocess.run([sys.executable, "-m", "gateway", "hash-key", "--generate"],
                          capture_output=True, text=True, check=True).stdout.split()
    assert len(made) == 2 and made[1] == digest(made[0]) and made[0].startswith("sk-gw-")


def test_an_open_gateway_beyond_loopback_says_so(caplog: pytest.LogCaptureFixture) -> None:
    from gateway.http.serving import warn_if_open

    caplog.set_level(logging.WARNING)
    assert warn_if_open(load_settings(), "0.0.0.0")
    assert "anyone who can reach this port" in caplog.text
    assert not warn_if_open(load_settings(), "127.0.0.1")
    assert not warn_if_open(load_settings(), "::1") and not warn_if_open(load_settings(),
                                                                         "localhost")
    assert not warn_if_open(load_settings(tenants=TENANTS, classes=CLASSES), "0.0.0.0")



# -- regressions from the adversarial pass ------------------------------------------------

def test_config_errors_never_echo_secrets() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(server={"admin_key": "ADMIN-S3CRET"},
                      backends=[{"name": "a", "api_key": "UPSTREAM-S3CRET"}],
                      tenants=[{"name": "t", "key_hashes": [digest("k")], "priority": "gold"}])
    assert "not a class" in str(info.value)
    assert "S3CRET" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_settings(backends=[{"name": "a", "api_key": "UPSTREAM-S3CRET"},
                                {"name": "a", "url": "http://other:1"}])
    assert "unique" in str(info.value) and "S3CRET" not in str(info.value)


async def test_a_batch_of_prompts_counts_every_prompt(make: Any) -> None:
    h = await make(tenants=[{**TENANTS[0], "tokens_per_minute": 10_000}])
    prompt = " ".join(["word"] * 30)
    r = await h.client.post("/v1/completions", headers=bearer(WEB_KEY), json={
        "prompt": [prompt] * 4, "max_tokens": 5})
    assert r.status_code == 200
    usage = r.json()["usage"]
    tenant = h.state.tenants.by_name["web"]
    assert tenant.used_tokens(h.state.clock.now()) == usage["prompt_tokens"] + usage[
        "completion_tokens"]
    assert usage["prompt_tokens"] > 4 * 30  # not only the longest prompt's


async def test_a_completion_counts_from_when_it_was_generated(make: Any, fake: FakeLlamaServer
                                                              ) -> None:
    fake.hold = asyncio.Event()
    clock = ManualClock()
    h = await make(tenants=[{**TENANTS[0], "tokens_per_minute": 400}], clock=clock)
    long = post(h, WEB_KEY)
    await asyncio.sleep(0.05)
    clock.advance(61)  # the prompt, held at arrival, has left the window
    fake.hold.set()
    assert (await long).status_code == 200
    assert h.state.tenants.by_name["web"].used_tokens(clock.now()) == 5  # the completion


async def test_a_reload_that_raises_max_inflight_lets_waiters_through(
        make: Any, fake: FakeLlamaServer) -> None:
    fake.hold = asyncio.Event()
    h = await make(tenants=[{**TENANTS[0], "max_inflight": 1}])
    calls = [post(h, WEB_KEY) for _ in range(3)]
    tenant = h.state.tenants.by_name["web"]
    await until(lambda: tenant.waiting >= 2)
    new = h.state.settings.model_copy(update={"tenants": load_settings(
        classes=CLASSES, tenants=[{**TENANTS[0], "max_inflight": 3}]).tenants})
    assert "tenants" in await reload(h.state, new)
    await until(lambda: h.backend.stats().inflight >= 3)  # the two at the gate went on at once
    assert h.state.tenants.by_name["web"] is tenant and tenant.waiting == 0
    fake.hold.set()
    assert [r.status_code for r in await asyncio.gather(*calls)] == [200] * 3
    assert tenant.inflight == 0


async def test_a_refusing_drain_refuses_requests_at_a_gate(make: Any, fake: FakeLlamaServer
                                                           ) -> None:
    fake.hold = asyncio.Event()
    h = await make(tenants=[{**TENANTS[0], "max_inflight": 1}],
                   server={"drain_queued": "refuse", "drain_timeout_s": 5})
    first = post(h, WEB_KEY)
    await asyncio.sleep(0.05)
    gated = post(h, WEB_KEY)
    await until(lambda: h.state.tenants.by_name["web"].waiting >= 1)
    drain = asyncio.ensure_future(h.state.drain())
    r = await gated
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    fake.hold.set()
    assert (await first).status_code == 200 and await drain
    assert len(fake.generations) == 1


async def test_a_non_ascii_key_works_as_sent(make: Any) -> None:
    key = "sk-clé-ünïcode"
    h = await make(tenants=[{"name": "u", "key_hashes": [digest(key)]}])
    r = await h.client.post(CHAT, json=chat_body(), headers=[
        (b"authorization", f"Bearer {key}".encode())])
    assert r.status_code == 200


async def test_odd_headers_and_priority_fields(make: Any, fake: FakeLlamaServer) -> None:
    h = await make()
    r = await h.client.post(CHAT, json=chat_body(), headers=[
        (b"authorization", b"Bearer sk-bad"), (b"authorization", f"Bearer {WEB_KEY}".encode())])
    assert r.status_code == 401 and "more than one" in r.json()["error"]["message"]
    r = await h.client.post(CHAT, json=chat_body(), headers={**bearer(WEB_KEY),
                                                             "x-priority": " "})
    assert r.status_code == 200  # a blank header: the tenant's own class
    for bad in ([1], {"a": 1}, True, 1.5):
        r = await h.client.post(CHAT, json=chat_body(priority=bad), headers=bearer(WEB_KEY))
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", bad
    r = await h.client.post(CHAT, json=chat_body(priority=None), headers=bearer(WEB_KEY))
    assert r.status_code == 200 and "priority" not in json.loads(fake.requests[-1].content)


# -- shared cases --------------------------------------------------------------------------

async def test_p11_one_high_priority_request_runs_after_thirty_low_ones_queued(
        make: Any, fake: FakeLlamaServer) -> None:
    """shared/cases/public.md P11, priority variant: 30 low-priority requests queued,
    then 1 high-priority one; the high one runs next."""
    fake.hold = asyncio.Event()
    h = await make(slots=1)
    running = post(h, BATCH_KEY, "running")
    await asyncio.sleep(0.05)
    low = [post(h, BATCH_KEY, f"low {i}") for i in range(30)]
    await until(lambda: h.backend.stats().queued >= 30)
    high = post(h, WEB_KEY, "high")
    await until(lambda: h.backend.stats().queued >= 31)
    fake.hold.set()
    assert all(r.status_code == 200 for r in await asyncio.gather(running, high, *low))
    order = [g["messages"][0]["content"] for g in fake.generations]
    assert order[:2] == ["running", "high"]


async def test_p11_a_refused_request_uses_no_other_quota(make: Any, fake: FakeLlamaServer
                                                          ) -> None:
    """P11: a request refused by one limit (max_queued, a full queue) takes nothing from
    the tenant's tokens per minute."""
    fake.hold = asyncio.Event()
    h = await make(slots=1, admission={"max_queue": 1, "reject_predicted_timeouts": False},
                   tenants=[{**TENANTS[0], "tokens_per_minute": 1000, "max_queued": 1},
                            TENANTS[1]])
    tenant = h.state.tenants.by_name["web"]
    running = post(h, WEB_KEY)
    await asyncio.sleep(0.05)
    queued = post(h, WEB_KEY)
    await until(lambda: h.backend.stats().queued >= 1)
    held = tenant.used_tokens(h.state.clock.now())
    refused = [await h.client.post(CHAT, json=chat_body(), headers=bearer(WEB_KEY))
               for _ in range(5)]
    assert {r.status_code for r in refused} <= {429, 503}
    assert tenant.used_tokens(h.state.clock.now()) == held == 16  # two prompts of 8
    fake.hold.set()
    await asyncio.gather(running, queued)
    assert tenant.used_tokens(h.state.clock.now()) == 2 * 13


async def test_p18_priority_and_tenant_labels_never_come_from_the_client(make: Any) -> None:
    """shared/cases/public.md P18: 200 requests with random classes, users and models
    add no series."""
    h = await make()

    def series() -> int:
        return sum(len(f.samples) for f in h.registry.collect())

    await h.client.post(CHAT, json=chat_body(), headers=bearer(WEB_KEY))
    await h.client.post(CHAT, json=chat_body(), headers={**bearer(WEB_KEY),
                                                         "x-priority": "nope"})
    await h.client.post(CHAT, json=chat_body(), headers=bearer("sk-unknown"))
    before = series()
    for i in range(200):
        await h.client.post(CHAT, json=chat_body(user=f"user-{i}", model=f"m-{i}"),
                            headers={**bearer(WEB_KEY), "x-priority": f"class-{i}"})
        await h.client.post(CHAT, json=chat_body(priority=f"p-{i}"), headers=bearer(
            f"sk-random-{i}"))
    assert series() == before


# -- Tenant's own counts, without the app --------------------------------------------------

def _tenant(**quota: Any) -> Any:
    from gateway.admission.tenants import Tenant
    from gateway.config import TenantSettings

    entry = TenantSettings(name="t", key_hashes=[digest("sk-t-0123456789")], **quota)
    return Tenant("t", entry, 0, "interactive")


def test_the_waiting_count_is_changed_only_through_the_tenant() -> None:
    from gateway.errors import RateLimited

    tenant = _tenant(max_queued=1)
    with tenant.counted_waiting(0.0):
        assert tenant.waiting == 1
        with pytest.raises(RateLimited) as info:
            tenant.start_waiting(0.0)  # a second would pass max_queued
        assert info.value.rejection_reason == "max_queued" and tenant.waiting == 1
    assert tenant.waiting == 0
    tenant.start_waiting(0.0)
    tenant.stop_waiting()
    assert tenant.waiting == 0


async def test_the_gate_passes_places_on_in_order_and_gives_back_a_cancelled_grant() -> None:
    clock = ManualClock()
    tenant = _tenant(max_inflight=1)
    assert await tenant.enter(5.0, clock) == 0.0  # a free place: at once
    second = asyncio.ensure_future(tenant.enter(5.0, clock))
    third = asyncio.ensure_future(tenant.enter(5.0, clock))
    for _ in range(5):
        await asyncio.sleep(0)
    assert tenant.waiting == 2 and tenant.inflight == 1
    clock.advance(1.0)
    tenant.leave()  # the place passes to the second, in arrival order
    second.cancel()  # cancelled as it was let through: the place goes on to the third
    with pytest.raises(asyncio.CancelledError):
        await second
    assert await third == 1.0
    assert tenant.waiting == 0 and tenant.inflight == 1
    tenant.leave()
    assert tenant.inflight == 0


def test_each_tenant_gets_its_quota_once_and_a_reload_keeps_it() -> None:
    """The quota is chosen when a tenant is made (issue 39): the factory is asked once
    per configured tenant, a reload keeps each kept tenant's own, and every step of the
    tenant goes to it."""
    from gateway.admission.tenants import LocalQuota, Tenants

    asked: list[str] = []
    calls: list[str] = []

    class Recording(LocalQuota):
        def enter_now(self, tenant: Any) -> bool:
            calls.append("enter_now")
            return super().enter_now(tenant)

        def leave(self, tenant: Any) -> None:
            calls.append("leave")
            super().leave(tenant)

    def quota_for(name: str) -> Recording:
        asked.append(name)
        return Recording()

    settings = load_settings(tenants=TENANTS, classes=CLASSES)
    tenants = Tenants(settings, quota_for=quota_for)
    assert sorted(asked) == sorted(t["name"] for t in TENANTS)
    first = {name: t.quota for name, t in tenants.by_name.items()}
    later = Tenants(settings, previous=tenants, quota_for=tenants.quota_for)
    assert {name: t.quota for name, t in later.by_name.items()} == first
    assert len(asked) == len(TENANTS)  # nothing asked again
    tenant = later.by_name[TENANTS[0]["name"]]
    assert tenant.enter_now() and tenant.inflight == 1
    tenant.leave()
    assert calls == ["enter_now", "leave"] and tenant.inflight == 0
    anonymous = Tenants(load_settings(), quota_for=quota_for).by_name["anonymous"]
    assert not isinstance(anonymous.quota, Recording)  # no quotas: nothing to count
