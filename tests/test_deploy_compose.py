"""The compose stack (deploy/compose) and the Grafana dashboard (deploy/grafana) of issue
12, checked without a container engine, which these machines lack: compose.yaml against
the Compose Specification's JSON schema (check-jsonschema's vendored copy), the YAML
with yamllint, the stack's Prometheus config with promtool, and the dashboard's
expressions parsed as PromQL by promtool. The files are then read as data: the gateway
config the stack mounts loads with the gateway's own loader, and its backends, ports
and capacity numbers are the ones the compose services are started with; Prometheus and
Grafana point at the services that exist; the gateway replicas share one budget in the
stack's Redis, and the stack's HAProxy balances over every replica and checks /ready
(tests/test_deploy.py runs ``haproxy -c`` on its config). Every gateway metric and label
the dashboard
reads is checked against the gateway's own /metrics after traffic, so that a renamed
metric cannot leave an empty panel."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import BackendKind, Settings, StateBackend, load_settings
from gateway.http.app import create_app
from tests.conftest import Harness
from tests.fakes import FakeLlamaServer
from tests.test_deploy import HAPROXY_CFG, haproxy_sections, haproxy_servers

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
COMPOSE = COMPOSE_DIR / "compose.yaml"
GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "gateway.json"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yaml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "gateway.yaml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"

promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                              reason="promtool is not installed (Debian: prometheus)")


# -- reading the files ------------------------------------------------------------------

def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def services() -> dict[str, dict[str, Any]]:
    return load_yaml(COMPOSE)["services"]


def defaults(text: str) -> str:
    """``${VAR:-default}`` as compose reads it with VAR unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)


def mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of each volume, short or long syntax."""
    found = []
    for entry in service.get("volumes", []):
        if isinstance(entry, dict):
            found.append((str(entry["source"]), str(entry["target"])))
        else:
            source, target = defaults(entry).split(":")[:2]
            found.append((source, target))
    return found


def bind_source(service: dict[str, Any], target: str) -> Path:
    """The repository path mounted at ``target`` (a bind mount relative to the compose
    file)."""
    sources = [s for s, t in mounts(service) if t == target]
    assert len(sources) == 1, (target, mounts(service))
    assert sources[0].startswith("."), sources[0]  # a path beside the compose file
    return (COMPOSE_DIR / sources[0]).resolve()


def exposed(service: dict[str, Any]) -> set[int]:
    return {int(str(port).split("/")[0]) for port in service.get("expose", [])}


def published(service: dict[str, Any]) -> set[int]:
    """Container ports published to the host."""
    ports = set()
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            ports.add(int(entry["target"]))
        else:
            ports.add(int(str(entry).split(":")[-1].split("/")[0]))
    return ports


def flag(command: list[str], *names: str) -> str | None:
    """The value given to the first of ``names`` found in ``command``."""
    for i, arg in enumerate(command):
        if arg in names:
            return command[i + 1]
    return None


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "//" in url else f"http://{url}")
    assert parts.hostname is not None and parts.port is not None, url
    return parts.hostname, parts.port


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m)", duration)
    assert match, duration
    return int(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[match.group(2)]


def gateway_service() -> tuple[str, dict[str, Any]]:
    """The one service built from the repository: the gateway's image."""
    built = {name: s for name, s in services().items() if "build" in s}
    assert len(built) == 1, sorted(built)
    return next(iter(built.items()))


def replicas() -> dict[str, dict[str, Any]]:
    """Every gateway replica: the services that run the gateway's image. Each is one
    container (its own name in haproxy.cfg and prometheus.yml), not scaled by compose."""
    _, built = gateway_service()
    found = {name: s for name, s in services().items() if s.get("image") == built["image"]}
    for name, service in found.items():
        assert service.get("deploy", {}).get("replicas", 1) == 1, name
        assert "scale" not in service, name
    return found


def environment(service: dict[str, Any]) -> dict[str, str]:
    """A service's ``environment``, map or list syntax."""
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(entry.split("=", 1) for entry in env)
    return {key: str(value) for key, value in env.items()}


def replica_settings(service: dict[str, Any]) -> Settings:
    """The settings a replica runs with: the config it mounts where the image reads it,
    under the ``GATEWAY_*`` variables of its environment."""
    with mock.patch.dict(os.environ, environment(service)):
        return load_settings(bind_source(service, dockerfile_config_path()))


def dockerfile_config_path() -> str:
    cmd = re.search(r"^CMD\s+(\[.*\])\s*$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert cmd is not None
    path = flag(json.loads(cmd.group(1)), "--config")
    assert path is not None
    return path


def compose_settings() -> Settings:
    _, service = gateway_service()
    return load_settings(bind_source(service, dockerfile_config_path()))


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=120, cwd=cwd,
                          check=False)


def python_tool(module: str, package: str) -> list[str]:
    """A tool of the test extras, run by this interpreter; else skip."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{package} is not installed (the test extras have it)")
    return [sys.executable, "-m", module]


# -- the compose file -------------------------------------------------------------------

def test_the_compose_file_follows_the_compose_specification(tmp_path: Path) -> None:
    check = python_tool("check_jsonschema", "check-jsonschema")
    done = run(*check, "--builtin-schema", "vendor.compose-spec", str(COMPOSE))
    assert done.returncode == 0, done.stdout + done.stderr
    # The schema does refuse what compose would refuse: a misspelt key in a service.
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace("    expose:\n", "    expsoe:\n", 1))
    done = run(*check, "--builtin-schema", "vendor.compose-spec", str(broken))
    assert done.returncode != 0 and "expsoe" in done.stdout + done.stderr


def test_the_compose_and_grafana_yaml_pass_yamllint(tmp_path: Path) -> None:
    lint = python_tool("yamllint", "yamllint")
    config = DEPLOY / ".yamllint"
    files = sorted(p.relative_to(ROOT) for d in (COMPOSE_DIR, GRAFANA)
                   for p in d.rglob("*") if p.suffix in (".yaml", ".yml"))
    assert len(files) >= 4, files  # compose, its prometheus.yml, two provisioning files
    done = run(*lint, "--strict", "-c", str(config), *map(str, files), cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    # The relaxed config still lints: a trailing space fails.
    bad = tmp_path / "bad.yaml"
    bad.write_text("key: value \n")
    done = run(*lint, "--strict", "-c", str(config), str(bad))
    assert done.returncode != 0 and "trailing-spaces" in done.stdout


def test_images_name_no_registry_host_and_are_pinned() -> None:
    for name, service in services().items():
        image = service.get("image")
        if image is None:
            continue
        if "build" in service:  # the gateway's own image, built here
            assert ":" in image, name
            continue
        if image.startswith("${"):
            # llama.cpp's image is on a registry whose host these files do not name: a
            # required variable, whose message points to the instructions.
            assert re.fullmatch(r"\$\{LLAMA_CPP_IMAGE:\?[^}]*deploy/README\.md\}", image), image
            continue
        repository, _, tag = image.partition(":")
        assert tag and tag != "latest", f"{name}: {image} is not pinned to a version"
        first = repository.split("/")[0]
        assert "." not in first and ":" not in first, f"{name}: {image} names a registry host"


def test_the_gateway_service_mounts_its_config_where_the_image_reads_it() -> None:
    _, built = gateway_service()
    build = built["build"]
    assert (COMPOSE_DIR / build["context"]).resolve() == ROOT
    assert (ROOT / build.get("dockerfile", "Dockerfile")).resolve() == ROOT / "Dockerfile"
    path = dockerfile_config_path()
    assert path == "/etc/gateway/config.toml"
    assert len(replicas()) == 2, sorted(replicas())
    for name, service in replicas().items():
        source = bind_source(service, path)
        assert source == COMPOSE_DIR / "gateway.toml", name
        # The image's CMD is what reads it: compose must not point the gateway elsewhere.
        assert "command" not in service or path in service["command"]
        settings = replica_settings(service)
        assert settings.server.host == "0.0.0.0"
        # Reached through the load balancer, which publishes the port; not directly.
        assert published(service) == set() and exposed(service) == {settings.server.port}
        # Prometheus scrapes /metrics without a key.
        assert settings.server.admin_key is None or settings.server.metrics_public
        # Compose waits longer than the drain before it kills the gateway.
        assert seconds(service["stop_grace_period"]) > settings.server.drain_timeout_s
        # Every backend is a compose service, reached on a port that service listens on.
        for backend in settings.backends:
            host, port = host_port(backend.url)
            assert host in services() and host not in replicas(), backend.url
            assert port in exposed(services()[host]), backend.url
        assert {b.kind for b in settings.backends} == {BackendKind.llama_cpp,
                                                        BackendKind.ollama}


def redis_service() -> tuple[str, dict[str, Any]]:
    """The compose service the replicas' redis_url names, and the port it is reached on."""
    (url,) = {replica_settings(s).state.redis_url for s in replicas().values()}
    parts = urlsplit(url)
    assert parts.scheme == "redis" and parts.hostname in services(), url
    return parts.hostname, services()[parts.hostname]


def test_the_replicas_share_one_budget_in_the_stacks_redis() -> None:
    settings = {name: replica_settings(s) for name, s in replicas().items()}
    # One budget per backend needs the same Redis, key prefix and backends everywhere:
    # indeed the same settings (two replicas with different backends' names would
    # reserve under different keys).
    assert len({s.model_dump_json() for s in settings.values()}) == 1
    state = next(iter(settings.values())).state
    assert state.backend is StateBackend.redis
    name, service = redis_service()
    assert service["image"].split(":")[0] == "redis"
    assert (urlsplit(state.redis_url).port or 6379) in exposed(service)
    assert published(service) == set()  # the compose network only: no password on it
    assert "redis-cli" in service["healthcheck"]["test"]
    # Persistence off: after a restart the replicas publish their state again.
    command = [str(arg) for arg in service["command"]]
    assert flag(command, "--save") == "" and flag(command, "--appendonly") == "no"
    for replica, spec in replicas().items():
        assert spec["depends_on"][name]["condition"] == "service_healthy", replica
    # A live replica that misses a renewal or two keeps its leases.
    assert state.lease_ttl_s >= 5 * state.renew_interval_s


def load_balancer() -> tuple[str, dict[str, Any]]:
    """The HAProxy service, and the config it mounts where its image reads it."""
    found = {n: s for n, s in services().items()
             if s.get("image", "").split(":")[0] == "haproxy"}
    assert len(found) == 1, sorted(found)
    return next(iter(found.items()))


def test_haproxy_balances_over_every_replica_and_checks_ready() -> None:
    _, lb = load_balancer()
    assert bind_source(lb, "/usr/local/etc/haproxy/haproxy.cfg") == HAPROXY_CFG
    assert "command" not in lb  # the image's default reads that file
    text = HAPROXY_CFG.read_text()
    port = next(iter({replica_settings(s).server.port for s in replicas().values()}))
    # Clients reach the stack at the port one gateway used to publish, on loopback.
    (frontend,) = [h for h in haproxy_sections(text) if h.startswith("frontend ")]
    (bind,) = [w for w in haproxy_sections(text)[frontend] if w[0] == "bind"]
    assert bind[1] == f":{port}" and published(lb) == {port}
    assert all(str(entry).startswith("127.0.0.1:") for entry in lb["ports"])
    # Every replica, on its port, with a health check; none other.
    servers = haproxy_servers(text)
    checked = {address for _, address, rest in servers if "backup" not in rest}
    assert checked == {f"{name}:{port}" for name in replicas()}
    assert all("check" in rest for _, _, rest in servers if "backup" not in rest)
    # The unchecked backups are the same replicas, used only when none is ready.
    backups = {address for _, address, rest in servers if "backup" in rest}
    assert backups == checked
    assert all("check" not in rest for _, _, rest in servers if "backup" in rest)
    backend = next(lines for h, lines in haproxy_sections(text).items()
                   if h.startswith("backend "))
    assert ["option", "httpchk"] in backend
    assert ["http-check", "send", "meth", "GET", "uri", "/ready"] in backend
    assert ["option", "allbackups"] in backend
    # It can start before the replicas resolve, and follows their new addresses.
    default_server = next(w for w in backend if w[0] == "default-server")
    assert "init-addr" in default_server and "resolvers" in default_server
    for replica in replicas():
        assert replica in lb["depends_on"]


def test_llama_server_is_started_with_the_layout_the_gateway_config_states() -> None:
    backends = [b for b in compose_settings().backends if b.kind is BackendKind.llama_cpp]
    assert backends
    for backend in backends:
        host, port = host_port(backend.url)
        service = services()[host]
        command = [str(arg) for arg in service["command"]]
        assert flag(command, "--port") == str(port)
        assert exposed(service) == {port}
        assert "--metrics" in command
        parallel = flag(command, "--parallel", "-np")
        if backend.slots is not None:
            assert parallel == str(backend.slots)
        # An explicit --parallel gives private slots unless --kv-unified is there too
        # (shared/design/backends.md 1.1): the config must say which.
        unified = parallel is None or bool({"--kv-unified", "-kvu"} & set(command))
        assert backend.unified == unified
        ctx = flag(command, "--ctx-size", "-c")
        if backend.pool_tokens is not None:
            assert unified and ctx == str(backend.pool_tokens)
        elif not unified and backend.ctx_per_slot is not None and backend.slots is not None:
            assert ctx == str(backend.slots * backend.ctx_per_slot)
        if backend.model is not None:
            assert flag(command, "--alias", "-a") == backend.model
        # The model file is under a directory mounted from the repository's side.
        model = PurePosixPath(str(flag(command, "--model", "-m")))
        assert bind_source(service, str(model.parent)).is_dir()
        # The health check asks the port the server listens on.
        check = " ".join(service["healthcheck"]["test"])
        assert re.search(rf"http://(127\.0\.0\.1|localhost):{port}/health\b", check), check


def test_ollama_is_started_with_the_slots_and_context_the_gateway_config_states() -> None:
    backends = [b for b in compose_settings().backends if b.kind is BackendKind.ollama]
    assert backends
    llama = next(b for b in compose_settings().backends if b.kind is BackendKind.llama_cpp)
    llama_service = services()[host_port(llama.url)[0]]
    gguf = str(flag(llama_service["command"], "--model", "-m"))
    for backend in backends:
        host, port = host_port(backend.url)
        service = services()[host]
        env = service["environment"]
        assert host_port(env["OLLAMA_HOST"])[1] == port and exposed(service) == {port}
        assert env["OLLAMA_NUM_PARALLEL"] == str(backend.slots)
        assert env["OLLAMA_CONTEXT_LENGTH"] == str(backend.ctx_per_slot)
        # A one-shot service creates the model the config names, in this Ollama, from
        # a Modelfile with the same context, over the GGUF llama-server serves.
        creators = [s for s in services().values()
                    if s.get("command", [])[:2] == ["create", backend.model]]
        assert len(creators) == 1, backend.model
        creator = creators[0]
        assert host_port(creator["environment"]["OLLAMA_HOST"]) == (host, port)
        assert creator["depends_on"][host]["condition"] == "service_healthy"
        modelfile = bind_source(creator, str(flag(creator["command"], "-f")))
        text = modelfile.read_text()
        assert re.search(rf"^PARAMETER num_ctx {backend.ctx_per_slot}$", text, re.MULTILINE)
        source = re.search(r"^FROM (\S+)$", text, re.MULTILINE)
        assert source is not None and source.group(1) == gguf
        directory = str(PurePosixPath(gguf).parent)
        assert bind_source(creator, directory) == bind_source(llama_service, directory)


# -- Prometheus -------------------------------------------------------------------------

def prometheus_config() -> tuple[dict[str, Any], Path]:
    service = services()["prometheus"]
    assert "command" not in service  # the image's default --config.file
    path = bind_source(service, "/etc/prometheus/prometheus.yml")
    return load_yaml(path), path


def scrape_jobs() -> dict[str, list[str]]:
    config, _ = prometheus_config()
    return {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
            for job in config["scrape_configs"]}


def test_prometheus_scrapes_the_compose_services_and_loads_the_alert_rules() -> None:
    config, _ = prometheus_config()
    service = services()["prometheus"]
    # The rule files, relative to the config, are deploy/prometheus's, mounted beside it.
    assert config["rule_files"]
    for rule_file in config["rule_files"]:
        target = str(PurePosixPath("/etc/prometheus") / rule_file)
        assert bind_source(service, target) == ALERTS
    jobs = scrape_jobs()
    for job, targets in jobs.items():
        for target in targets:
            host, port = host_port(target)
            assert host in services() and port in exposed(services()[host]), (job, target)
    # The gateway's job is the one the alerts read (GatewayDown: up{job="llm-gateway"}).
    # Each replica is scraped directly (not through haproxy, which would alternate).
    port = compose_settings().server.port
    assert sorted(jobs["llm-gateway"]) == sorted(f"{name}:{port}" for name in replicas())
    assert set(re.findall(r'job="([^"]+)"', ALERTS.read_text())) <= set(jobs)
    # So is every job the dashboard names.
    named = {job for _, expr in expressions()
             for alternatives in re.findall(r'job=~?"([^"]+)"', expr)
             for job in alternatives.split("|")}
    assert named and named <= set(jobs), named
    # llama-server's own /metrics, on the port it serves.
    llama = next(b for b in compose_settings().backends if b.kind is BackendKind.llama_cpp)
    host, port = host_port(llama.url)
    assert f"{host}:{port}" in jobs["llama-server"]


@promtool
def test_the_stacks_prometheus_config_and_its_rules_pass_promtool(tmp_path: Path) -> None:
    config, path = prometheus_config()
    shutil.copy(path, tmp_path / "prometheus.yml")
    for rule_file in config["rule_files"]:
        shutil.copy(ALERTS, tmp_path / rule_file)
    done = run("promtool", "check", "config", "prometheus.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"SUCCESS: [1-9]\d* rules found", done.stdout), done.stdout


# -- Grafana ----------------------------------------------------------------------------

def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict[str, Any]]:
    return dashboard()["panels"]


def expressions() -> list[tuple[str, str]]:
    """(panel title, expression) of every target."""
    return [(p["title"], t["expr"]) for p in panels() for t in p["targets"]]


def datasource_uid() -> str:
    (source,) = load_yaml(DATASOURCES)["datasources"]
    return source["uid"]


def test_grafana_is_provisioned_with_the_data_source_and_the_dashboard() -> None:
    service = services()["grafana"]
    assert bind_source(service, "/etc/grafana/provisioning") == GRAFANA / "provisioning"
    (source,) = load_yaml(DATASOURCES)["datasources"]
    assert source["type"] == "prometheus"
    host, port = host_port(source["url"])
    assert host in services() and port in exposed(services()[host])
    assert services()[host]["image"].split(":")[0] == "prom/prometheus"
    # $__rate_interval is built from the scrape interval Grafana is told.
    config, _ = prometheus_config()
    intervals = {config["global"]["scrape_interval"]} | {
        job["scrape_interval"] for job in config["scrape_configs"] if "scrape_interval" in job}
    assert intervals == {source["jsonData"]["timeInterval"]}
    (provider,) = load_yaml(PROVIDERS)["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    assert bind_source(service, path) == DASHBOARD.parent
    home = service["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert PurePosixPath(home).parent == PurePosixPath(path)
    assert (DASHBOARD.parent / PurePosixPath(home).name).is_file()


def test_the_dashboard_is_well_formed() -> None:
    board = dashboard()
    assert board["title"] and board["uid"] and board["schemaVersion"] >= 39
    uid = datasource_uid()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and len(ids) >= 11
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        assert panel["title"].strip() and panel.get("description"), panel["id"]
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"]["uid"] == uid
        # Panels fit the 24-column grid without overlapping.
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"]) for dy in range(pos["h"])}
        assert not mine & cells, panel["title"]
        cells |= mine
    (variable,) = board["templating"]["list"]
    assert variable["name"] == "backend" and variable["datasource"]["uid"] == uid
    query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
    assert query == "label_values(gateway_kv_capacity_tokens, backend)"
    # "All" must match every backend, "none" (refusals before routing) included.
    assert variable["includeAll"] and variable["multi"] and variable["allValue"] == ".*"


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bgateway_\w+", expr))


def grouping(expr: str) -> set[str]:
    return {label.strip() for labels in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
            for label in labels.split(",") if label.strip()}


def matched_labels(expr: str) -> set[str]:
    return {name for selector in re.findall(r"\{([^}]*)\}", expr)
            for name in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", selector)}


def quantiles(expr: str) -> set[tuple[float, str]]:
    return {(float(q), name) for q, name in re.findall(
        r"histogram_quantile\(\s*([0-9.]+)\s*,.*?\b(gateway_\w+?)_bucket\b", expr, re.DOTALL)}


# What the issue asks to see: (what, metrics one panel must read, quantiles of
# histograms it must show, labels it must break the series down by).
REQUIRED_PANELS: list[tuple[str, set[str], set[tuple[float, str]], set[str]]] = [
    ("queue depth against its capacity", {"gateway_queue_depth", "gateway_queue_capacity"},
     set(), set()),
    ("queue wait p95", {"gateway_queue_wait_seconds_bucket"},
     {(0.95, "gateway_queue_wait_seconds")}, {"backend"}),
    ("KV reserved, live and capacity", {"gateway_kv_reserved_tokens", "gateway_kv_live_tokens",
                                        "gateway_kv_capacity_tokens"}, set(), set()),
    ("in flight against slots", {"gateway_inflight_requests", "gateway_slots_busy",
                                 "gateway_slots"}, set(), set()),
    ("rejections by reason", {"gateway_rejections_total"}, set(), {"reason"}),
    ("TTFT p50 and p95", {"gateway_ttft_seconds_bucket"},
     {(0.5, "gateway_ttft_seconds"), (0.95, "gateway_ttft_seconds")}, {"backend"}),
    ("ITL p95", {"gateway_itl_seconds_bucket"}, {(0.95, "gateway_itl_seconds")}, {"backend"}),
    ("prompt and completion tokens p95", {"gateway_prompt_tokens_bucket",
                                          "gateway_completion_tokens_bucket"},
     {(0.95, "gateway_prompt_tokens"), (0.95, "gateway_completion_tokens")}, {"backend"}),
    ("upstream errors by kind", {"gateway_upstream_errors_total"}, set(), {"kind"}),
    ("tokens per tenant", {"gateway_tenant_tokens_total"}, set(), {"tenant", "kind"}),
    ("backend up", {"gateway_backend_up"}, set(), set()),
]


@pytest.mark.parametrize(("what", "metrics", "wanted", "by"), REQUIRED_PANELS,
                         ids=[r[0] for r in REQUIRED_PANELS])
def test_the_dashboard_has_each_panel_the_issue_asks_for(
        what: str, metrics: set[str], wanted: set[tuple[float, str]], by: set[str]) -> None:
    for panel in panels():
        exprs = [t["expr"] for t in panel["targets"]]
        if (metrics <= set().union(*map(metric_names, exprs))
                and wanted <= set().union(*map(quantiles, exprs))
                and by <= set().union(*map(grouping, exprs))):
            return
    pytest.fail(f"no panel shows {what}")


def test_the_dashboard_rates_counters_over_rate_interval_and_filters_by_backend() -> None:
    for title, expr in expressions():
        # Counters and histogram buckets only inside rate(...[$__rate_interval]), gauges
        # never; no range but $__rate_interval; no variable but $backend and it.
        rated = dict(re.findall(r"\brate\(\s*(\w+)(?:\{[^}]*\})?\[([^\]]+)\]\s*\)", expr))
        for name in metric_names(expr):
            counter = name.endswith(("_total", "_bucket"))
            assert (name in rated) == counter, (title, name)
        assert set(rated.values()) <= {"$__rate_interval"}, title
        assert set(re.findall(r"\[([^\]]+)\]", expr)) <= {"$__rate_interval"}, title
        assert "$" not in expr.replace("$backend", "").replace("$__rate_interval", ""), title
        # A multi-valued variable expands to a regex: =~, never =.
        assert '{backend="$backend"' not in expr.replace(" ", ""), title
        assert "gateway_slots_total" not in expr  # renamed gateway_slots


def promql(expr: str) -> str:
    """The expression as Prometheus gets it with every backend selected."""
    return expr.replace("$backend", ".*").replace("$__rate_interval", "1m")


def check_rules(exprs: list[str], where: Path) -> subprocess.CompletedProcess[str]:
    rules = [{"record": f"dashboard_expr_{i}", "expr": promql(e)} for i, e in enumerate(exprs)]
    where.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    return run("promtool", "check", "rules", str(where))


@promtool
def test_every_dashboard_expression_is_valid_promql(tmp_path: Path) -> None:
    exprs = [expr for _, expr in expressions()]
    done = check_rules(exprs, tmp_path / "dashboard.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in done.stdout
    # promtool does parse them: a broken one fails.
    done = check_rules(["sum by (backend (rate(gateway_itl_seconds_count[1m]))"],
                       tmp_path / "broken.yml")
    assert done.returncode != 0


# -- against the gateway's own /metrics -------------------------------------------------

TENANT_KEY = "sk-dashboard-tenant-0123"


@pytest.fixture
async def tenant_harness(fake: FakeLlamaServer) -> Any:
    settings = load_settings(
        admission={"disconnect_grace_s": 0.0},
        # two backends of one model, so that the pool's shared queue has its gauges
        backends=[{"name": "local", "url": "http://upstream:8080", "model": "m"},
                  {"name": "local-2", "url": "http://upstream-2:8080", "model": "m"}],
        tenants=[{"name": "team-a",
                  "key_hashes": [hashlib.sha256(TENANT_KEY.encode()).hexdigest()]}])
    app = create_app(settings, http_client=fake.client(), registry=CollectorRegistry(),
                     discover=False)
    h = Harness(app, fake)
    for backend in h.state.fleet.backends.values():
        await backend.discover()
    yield h
    await h.client.aclose()


async def test_the_dashboard_reads_metrics_and_labels_the_gateway_exports(
        tenant_harness: Harness, fake: FakeLlamaServer) -> None:
    h = tenant_harness
    key = {"authorization": f"Bearer {TENANT_KEY}"}
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
    # One request of each kind the panels show: a tenant's stream (latencies, tokens,
    # tenant tokens), a refusal, and a backend failure.
    r = await h.client.post("/v1/chat/completions", json={**body, "stream": True},
                            headers=key)
    assert r.status_code == 200 and "[DONE]" in r.text
    r = await h.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 401
    fake.mode = "boom"
    r = await h.client.post("/v1/chat/completions", json=body, headers=key)
    assert r.status_code >= 500
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families((await h.client.get("/metrics")).text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    assert "backend" in labels["gateway_kv_capacity_tokens"]  # the $backend variable
    for title, expr in expressions():
        used = metric_names(expr)
        missing = used - set(labels)
        assert not missing, (title, missing)  # renamed, or never has a sample
        if not used:
            continue
        carried = set().union(*(labels[name] for name in used)) | {"le"}
        assert grouping(expr) | matched_labels(expr) <= carried, title
        # Filtered by the backend variable exactly when the metrics have the label.
        per_backend = all("backend" in labels[name] for name in used)
        assert per_backend == ('backend=~"$backend"' in expr), title
