"""A real ``redis-server`` on loopback for the shared-state tests
(:class:`gateway.dev.redisserver.RedisServer`), the test skipped only where the binary is
missing (``.ci/run`` installs it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.dev import redisserver

__all__ = ["RedisServer", "start_redis"]


class RedisServer(redisserver.RedisServer):
    """:class:`gateway.dev.redisserver.RedisServer`, skipping the test when the binary is
    missing."""

    def start(self) -> RedisServer:
        try:
            super().start()
        except redisserver.RedisMissing as exc:
            pytest.skip(str(exc))
        return self


def start_redis(workdir: Path) -> RedisServer:
    """A started server in ``workdir``."""
    return RedisServer(workdir).start()
