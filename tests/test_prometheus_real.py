"""A real Prometheus (Debian's ``prometheus`` package, which .ci/run installs) on
loopback scrapes a gateway served by uvicorn on a real port while this test sends it
traffic; PromQL queries over Prometheus's HTTP API then return the series the dashboard
and the alert rules read. Every expression of deploy/prometheus/alerts.yml and of the
Grafana dashboard (deploy/grafana/dashboards/*.json) is also evaluated there, so that
none is invalid PromQL or names a series the gateway does not export. Skipped when the
``prometheus`` binary is absent."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.dev.localbackend import free_port
from tests.conftest import SettingsFactory
from tests.fakes import FakeLlamaServer
from tests.served import served

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="prometheus is not installed (Debian: prometheus)")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A Prometheus on a free loopback port; yields its URL and its config file, which
    the test writes before calling ``/-/reload``."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "prometheus failed"
            time.sleep(0.2)
        yield base, config
    finally:
        proc.terminate()
        proc.wait(30)


def _dashboard_expressions() -> list[str]:
    exprs = []
    for path in sorted((DEPLOY / "grafana").rglob("*.json")):
        panels = json.loads(path.read_text()).get("panels", [])
        for panel in panels + [p for row in panels for p in row.get("panels", [])]:
            exprs += [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
    return exprs


def _concrete(expr: str) -> str:
    """A dashboard expression with Grafana's variables replaced as Grafana would."""
    return (expr.replace("$__rate_interval", "1m").replace("${backend:regex}", ".*")
            .replace("$backend", ".*").replace("${backend}", ".*")
            .replace("$tenant", ".*").replace("${tenant}", ".*"))


def test_a_real_prometheus_scrapes_the_gateway_and_answers_the_queries(
        prometheus: tuple[str, Path], make_settings: SettingsFactory,
        fake: FakeLlamaServer) -> None:
    base, config = prometheus
    with served(make_settings(), fake.client()) as port:
        gateway = f"http://127.0.0.1:{port}"
        rules = DEPLOY / "prometheus" / "alerts.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files: [{rules}]\n"
            "scrape_configs:\n  - job_name: llm-gateway\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n")
        assert httpx.post(f"{base}/-/reload", timeout=10).status_code == 200
        body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}
        for _ in range(6):
            r = httpx.post(f"{gateway}/v1/chat/completions", json={**body, "stream": True},
                           timeout=10)
            assert r.status_code == 200
        refused = httpx.post(f"{gateway}/v1/chat/completions", timeout=10,
                             json={**body, "max_tokens": 10**7})
        assert refused.status_code == 400
        reason = refused.json()["error"]["code"]
        # Wait for a scrape that saw all of it.
        deadline = time.monotonic() + 30
        while True:
            got = _query(base, f'sum(gateway_rejections_total{{reason="{reason}"}})')
            if got and float(got[0]["value"][1]) == 1:
                break
            assert time.monotonic() < deadline, got
            time.sleep(0.5)
        up = _query(base, 'up{job="llm-gateway"}')
        assert [float(s["value"][1]) for s in up] == [1.0]
        served_ok = _query(base, 'sum(gateway_requests_total{route="chat",code="200"})')
        assert float(served_ok[0]["value"][1]) == 6
        ttft = _query(base, "histogram_quantile(0.95, sum by (le, backend) "
                            "(gateway_ttft_seconds_bucket))")
        assert ttft and ttft[0]["metric"]["backend"] == "local"
        assert 0 < float(ttft[0]["value"][1]) < 10
        capacity = _query(base, "gateway_kv_capacity_tokens")
        assert float(capacity[0]["value"][1]) > 0
        # Each alert rule was loaded and evaluated without error, and each dashboard
        # query is valid PromQL.
        deadline = time.monotonic() + 15
        while True:
            groups = httpx.get(f"{base}/api/v1/rules", timeout=10).json()["data"]["groups"]
            loaded = [rule for group in groups for rule in group["rules"]]
            if loaded and all(rule["health"] == "ok" for rule in loaded):
                break
            assert time.monotonic() < deadline, loaded
            time.sleep(0.5)
        assert len(loaded) == len(re.findall(r"- alert: ", rules.read_text()))
        exprs = _dashboard_expressions()
        if (DEPLOY / "grafana").exists():
            assert len(exprs) >= 8
        for expr in exprs:
            _query(base, _concrete(expr))  # fails on a PromQL error
