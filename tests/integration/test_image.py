"""The container image, built from the repository's Dockerfile and run as a user runs it,
in front of the real llama-server (issue 40).

Podman (Debian's) builds it with ``--format docker`` (its default OCI format drops the
``HEALTHCHECK``) and runs it with the host's network, a read-only root and the
configuration file mounted where the Dockerfile reads it; the file sets a port of its own,
so the health check must take the port from the file. Where podman is not installed, or
cannot run a container here, the tests are skipped with the reason; where no registry
serves the base image, a stand-in is made (tests/podman.py) and the output says so.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.dev.localbackend import LlamaServer, free_port

from ..podman import BASE, Podman, ensure_base
from .conftest import StreamInFlight

pytestmark = pytest.mark.llama

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "localhost/llm-admission-gateway:test"
UNPRIVILEGED_UID = "10001"  # the Dockerfile's USER
STOP_TIMEOUT_S = 40  # docs/deploy.md's --stop-timeout, over the 30 s drain


def _say(request: pytest.FixtureRequest, line: str) -> None:
    """A line in pytest's own output, not captured."""
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin(
        "capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"[image] {line}")


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Podman:
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed")
    engine = Podman(tmp_path_factory.mktemp("podman"))
    info = engine("info", check=False, timeout=60)
    if info.returncode != 0:
        pytest.skip(f"podman cannot run here: {info.stderr.strip()[-300:]}")
    return engine


@pytest.fixture(scope="module")
def image(podman: Podman, request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """The image, built from the working tree (its base made when it cannot be pulled):
    its name, and the bytes its own layers add to the base."""
    try:
        _say(request, ensure_base(podman, tmp_path_factory.mktemp("base")))
    except RuntimeError as exc:
        pytest.skip(str(exc))
    trial = podman("run", "--rm", "--network", "host", BASE, "true", check=False)
    if trial.returncode != 0:
        pytest.skip(f"podman cannot start a container here: {trial.stderr.strip()[-300:]}")
    podman("build", "--format", "docker", "--network", "host", "--tag", IMAGE, str(ROOT),
           timeout=900)
    size = int(podman("image", "inspect", IMAGE, "--format", "{{.Size}}").stdout)
    base = int(podman("image", "inspect", BASE, "--format", "{{.Size}}").stdout)
    _say(request, f"{IMAGE}: {size / 1e6:.0f} MB, of which {(size - base) / 1e6:.0f} MB "
                  f"over its base")
    return IMAGE, size - base


def test_the_size_in_the_deploy_docs_is_the_measured_one(image: tuple[str, int]) -> None:
    found = re.search(r"about (\d+) MB over its base", (ROOT / "docs/deploy.md").read_text())
    assert found is not None, "docs/deploy.md gives no image size"
    documented = int(found.group(1)) * 1e6
    assert documented * 0.75 <= image[1] <= documented * 1.33, (
        f"the image adds {image[1] / 1e6:.0f} MB; docs/deploy.md says {found.group(1)} MB")


@pytest.fixture
def container(podman: Podman, image: tuple[str, int], default_server: LlamaServer,
              tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The image running (detached) in front of the real llama-server; its name and URL.

    The port is set only in the mounted file, not by ``GATEWAY_SERVER__PORT``."""
    port = free_port()
    config = tmp_path / "config.toml"
    config.write_text(f"[server]\nport = {port}\n"
                      f'[[backends]]\nname = "local"\nurl = "{default_server.url}"\n')
    config.chmod(0o644)
    name = f"gateway-test-{port}"
    podman("run", "--detach", "--name", name, "--network", "host", "--read-only",
           "--stop-timeout", str(STOP_TIMEOUT_S),
           "--volume", f"{config}:/etc/gateway/config.toml:ro", image[0])
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(podman, name, url)
        yield name, url
    finally:
        podman("rm", "--force", "--time", "0", name, check=False)


def _wait_ready(podman: Podman, name: str, url: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    logs = podman("logs", name, check=False)
    raise AssertionError(f"the container was not ready in {timeout_s:g} s:\n"
                         f"{logs.stdout[-3000:]}{logs.stderr[-3000:]}")


def _health(podman: Podman, name: str) -> str:
    """The container's health status after podman runs its HEALTHCHECK once (podman
    runs it on a systemd timer, which a machine without systemd does not have)."""
    podman("healthcheck", "run", name, check=False)
    state = json.loads(podman("inspect", name, "--format", "{{json .State}}").stdout)
    return str((state.get("Health") or state.get("Healthcheck") or {}).get("Status"))


def test_the_image_serves_chats_streams_and_metrics_as_an_unprivileged_healthy_process(
        podman: Podman, container: tuple[str, str]) -> None:
    name, url = container
    chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] > 0
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Count to five."}],
            "max_tokens": 16, "stream": True}) as streamed:
        text = "".join(streamed.iter_text())
    assert streamed.status_code == 200 and text.rstrip().endswith("data: [DONE]"), text
    metrics = httpx.get(url + "/metrics", timeout=10)
    assert metrics.status_code == 200
    assert 'gateway_requests_total{' in metrics.text
    assert _health(podman, name) == "healthy"
    uid = podman("exec", name, "id", "-u").stdout.strip()
    assert uid == UNPRIVILEGED_UID
    written = podman("exec", name, "touch", "/etc/gateway/x", check=False)
    assert written.returncode != 0  # a read-only root, as the docs run it


def test_podman_stop_lets_a_stream_in_flight_finish_and_the_gateway_exits_0(
        podman: Podman, container: tuple[str, str]) -> None:
    name, url = container
    stream = StreamInFlight(url)
    assert stream.begin(), "no first event"
    began = time.monotonic()
    podman("stop", "--time", str(STOP_TIMEOUT_S), name, timeout=STOP_TIMEOUT_S + 30)
    stopped_s = time.monotonic() - began
    text = stream.text(60)
    assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text[-500:]
    code = podman("inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip()
    assert code == "0", podman("logs", name, check=False).stderr[-3000:]
    assert stopped_s < STOP_TIMEOUT_S  # it exited by itself, within the grace period
