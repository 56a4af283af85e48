"""llama-server's own /metrics (started with --metrics, as deploy/compose/compose.yaml
starts it) exports every ``llamacpp:`` series the Grafana dashboard reads, so that its
llama-server panel cannot go empty after a rename upstream. Real llama-server, Gemma 3
270M."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer

pytestmark = pytest.mark.llama

DASHBOARD = (Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards"
             / "gateway.json")


def test_llama_server_exports_the_series_the_dashboard_reads(
        default_server: LlamaServer) -> None:
    used = set(re.findall(r"llamacpp:\w+", DASHBOARD.read_text()))
    assert used, "the dashboard has a llama-server panel"
    json.loads(DASHBOARD.read_text())
    r = httpx.get(f"{default_server.url}/metrics", timeout=30)
    assert r.status_code == 200
    exported = set(re.findall(r"^# TYPE (llamacpp:\w+) ", r.text, flags=re.MULTILINE))
    assert used <= exported, used - exported
