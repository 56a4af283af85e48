"""Podman for the image test (tests/integration/test_image.py): an engine configuration a
plain Debian machine without systemd accepts, and a stand-in base image where no registry
can be reached.

What needed changing on such a machine (Debian 12, root, podman 4.3, seen 2026-12):

* crun refuses a host whose cgroups are in hybrid mode ("cgroups in hybrid mode not
  supported"): runc is used when it is installed, with the cgroupfs manager (no systemd).
* podman raises a container's open-file and process limits above the host's hard limits,
  which runc then cannot set ("error setting rlimits"): the limits are capped at the
  host's.
* the events journal needs systemd: events go to a file.

The stand-in base: the Dockerfile starts ``FROM python:3.11-slim``. Where that image cannot
be pulled, one of the same name is made from Debian 12's own packages with mmdebstrap
(Python 3.11, pip, the CA certificates of this host so that pip inside the build trusts
the same registries as pip outside it), and the test says so in its output.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

BASE = "docker.io/library/python:3.11-slim"
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # Debian's bundle, ca-certificates


class Podman:
    """``podman`` with the test's own engine configuration (``CONTAINERS_CONF``)."""

    def __init__(self, conf_dir: Path):
        conf = conf_dir / "containers.conf"
        conf.write_text(engine_conf())
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def __call__(self, *args: str, timeout: float = 120, check: bool = True,
                 input_bytes: bytes | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``podman args...``; with ``check``, a non-zero exit raises AssertionError
        carrying podman's output."""
        done = subprocess.run(["podman", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}:\n"
                                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def has_image(self, name: str) -> bool:
        return self("image", "exists", name, check=False).returncode == 0


def _limit(kind: int, wanted: int) -> str:
    """``soft:hard`` of ``wanted``, capped at the host's hard limit of ``kind``."""
    hard = resource.getrlimit(kind)[1]
    value = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    return f"{value}:{value}"


def engine_conf() -> str:
    """A containers.conf (TOML) for a machine without systemd; see the module docstring."""
    runtime = 'runtime = "runc"\n' if shutil.which("runc") else ""
    return ("[containers]\n"
            f'default_ulimits = ["nofile={_limit(resource.RLIMIT_NOFILE, 4096)}", '
            f'"nproc={_limit(resource.RLIMIT_NPROC, 4096)}"]\n'
            "[engine]\n"
            f'{runtime}cgroup_manager = "cgroupfs"\nevents_logger = "file"\n')


def stand_in_base(podman: Podman, work: Path) -> None:
    """Make ``BASE`` from Debian 12's packages with mmdebstrap and import it.

    Like the real image: ``python``, ``pip``, ``groupadd``/``useradd``, and pip free to
    install into the system (Debian's EXTERNALLY-MANAGED marker removed). About 25 s and
    245 MB (larger than the real slim image, which has no Debian python3 packages).

    Raises:
        subprocess.CalledProcessError: mmdebstrap failed (no Debian mirror reachable).
    """
    tarball = work / "base.tar"
    hooks: Sequence[str] = (
        f"upload {HOST_CA_BUNDLE} {HOST_CA_BUNDLE}",
        'rm -f "$1"/usr/lib/python3.11/EXTERNALLY-MANAGED',
        'ln -sf python3 "$1"/usr/bin/python && ln -sf pip3 "$1"/usr/bin/pip',
    )
    subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase",
                    "--include=python3,python3-pip,ca-certificates,passwd",
                    *(f"--customize-hook={hook}" for hook in hooks),
                    "bookworm", str(tarball)], check=True, capture_output=True, timeout=900)
    podman("import", "--change", "ENV LANG=C.UTF-8", "--change", 'CMD ["python3"]',
           str(tarball), BASE, timeout=300)
    tarball.unlink()


def ensure_base(podman: Podman, work: Path) -> str:
    """Make sure ``BASE`` is in podman's store; returns how it got there (for the output).

    Raises:
        RuntimeError: it could not be pulled and mmdebstrap is not installed.
    """
    if podman.has_image(BASE):
        return f"{BASE}: already present"
    if podman("pull", "--quiet", BASE, check=False, timeout=300).returncode == 0:
        return f"{BASE}: pulled"
    if shutil.which("mmdebstrap") is None:
        raise RuntimeError(f"{BASE} cannot be pulled and mmdebstrap is not installed")
    stand_in_base(podman, work)
    return f"{BASE}: no registry reachable; a stand-in made from Debian 12 with mmdebstrap"
