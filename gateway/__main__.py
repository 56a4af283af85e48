"""Command line: ``gateway serve``, ``gateway check-config`` (also ``python -m gateway``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from gateway.config import ConfigError, load_settings

__all__ = ["main"]


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app

    settings = load_settings(args.config)
    server = settings.server.model_copy(
        update={k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    )
    logging.basicConfig(
        level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(settings)
    uvicorn.run(
        app, host=server.host, port=server.port, log_level=server.log_level,
        loop="uvloop", http="httptools", timeout_graceful_shutdown=5,
    )
    return 0


def _check(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    print(json.dumps(settings.model_dump(mode="json"), indent=2))  # noqa: T201
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``gateway`` argument parser."""
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", help="TOML config file (default: defaults + GATEWAY_* env)")
    serve.add_argument("--host", help="listen address (overrides server.host)")
    serve.add_argument("--port", type=int, help="listen port (overrides server.port)")
    serve.set_defaults(func=_serve)
    check = sub.add_parser("check-config", help="validate a config file and print the result")
    check.add_argument("config", help="TOML config file")
    check.set_defaults(func=_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. Returns the process exit code (2 for a bad configuration)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)  # noqa: T201
        return 2


if __name__ == "__main__":
    sys.exit(main())
