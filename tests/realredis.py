"""A real ``redis-server`` on loopback for the shared-state tests
(:class:`gateway.dev.redisserver.RedisServer`), the test skipped only where the binary is
missing (``.ci/run`` installs it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.dev.redisserver import RedisMissing, RedisServer

__all__ = ["RedisServer", "start_redis"]


def start_redis(workdir: Path) -> RedisServer:
    """A started server in ``workdir``; skips the test when redis-server is missing."""
    try:
        return RedisServer(workdir).start()
    except RedisMissing as exc:
        pytest.skip(str(exc))
