"""Command line: gateway serve, health, check-config, plan, probe and hash-key (also
python -m gateway). gateway COMMAND --help describes each."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.config import (
    BackendSettings,
    ConfigError,
    Settings,
    backends_from_args,
    load_settings,
    redact_url,
    settings_toml,
)

if TYPE_CHECKING:
    from gateway.planner.planning import ModelShape

__all__ = ["main"]


def _cli_backends(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """The backends ``--backend`` gives (``None``: none given), each with its kind: the
    one given, else the one the server shows (:func:`gateway.planner.probe.probe`, the
    detection of ``gateway probe``).

    :raises ConfigError: an argument cannot be read, or a server's kind cannot be told
        (it is not reachable, or is none of the kinds).
    """
    if not args.backend:
        return None
    entries: list[dict[str, Any]] = backends_from_args(args.backend)
    for entry in entries:
        if "kind" in entry:
            continue
        from gateway.planner.probe import probe

        key = BackendSettings(**entry).api_key  # read from api_key_file, when given
        found = probe(entry["url"], api_key=key.get_secret_value() if key else None)
        if found["kind"] == "unknown":
            raise ConfigError(f"--backend {redact_url(entry['url'])}: the kind of server "
                              f"cannot be told: {found['error']}. Start the server first, or give "
                              "kind=llama.cpp, kind=ollama or kind=vllm")
        entry["kind"] = found["kind"]
        print(f"gateway: backend {entry['name']!r} at {redact_url(entry['url'])} is "  # noqa: T201
              f"{found['kind']} (detected; kind= skips the detection)", file=sys.stderr)
    return entries


def _settings(args: argparse.Namespace, backends: list[dict[str, Any]] | None) -> Settings:
    """The settings: the file (if any), the environment, and ``--backend`` in place of
    the file's ``[[backends]]``."""
    return load_settings(args.config, **({"backends": backends} if backends else {}))


#: Where a wildcard listen address is reached from the same host (the health check).
_LOOPBACK = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}


def health_url(host: str, port: int) -> str:
    """The URL of ``GET /health`` of a gateway listening on ``host`` (``server.host``:
    one address, or several separated by commas, the first taken) and ``port``, from
    the same machine: a wildcard address is reached on the loopback."""
    first = host.split(",")[0].strip()
    first = _LOOPBACK.get(first, first).strip("[]")
    return f"http://{f'[{first}]' if ':' in first else first}:{port}/health"


def _health(args: argparse.Namespace) -> int:
    """``gateway health``: exit 0 when the gateway these settings describe answers
    ``GET /health`` with 200 within ``--timeout`` seconds, else 1 (a container's
    ``HEALTHCHECK``: it finds the port wherever the settings take it from, the file or
    ``GATEWAY_SERVER__PORT``)."""
    import httpx

    settings = _settings(args, None)
    if settings.server.port == 0:
        print("gateway health: server.port is 0 (a random port): nothing to check",  # noqa: T201
              file=sys.stderr)
        return 1
    url = health_url(settings.server.host, settings.server.port)
    try:
        status = httpx.get(url, timeout=args.timeout).status_code
    except httpx.HTTPError as exc:
        print(f"gateway health: {url}: {exc!r}", file=sys.stderr)  # noqa: T201
        return 1
    if status != 200:
        print(f"gateway health: {url}: HTTP {status}", file=sys.stderr)  # noqa: T201
    return 0 if status == 200 else 1


def _serve(args: argparse.Namespace) -> int:
    from gateway.http.app import create_app
    from gateway.http.serving import serve
    from gateway.observe.logs import configure_logging

    backends = _cli_backends(args)
    if backends:
        # As GATEWAY_BACKENDS, which this process's workers and a reload read again.
        os.environ["GATEWAY_BACKENDS"] = json.dumps(backends)
    settings = _settings(args, None)
    server = settings.server.model_copy(
        update={k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    )
    configure_logging(server)
    if args.workers > 1:
        from gateway.config import StateBackend
        from gateway.http.serving import serve_workers

        if settings.state.backend is not StateBackend.redis:
            print(f"gateway serve: --workers {args.workers} needs [state] backend = "  # noqa: T201
                  '"redis": each worker would otherwise admit as if it alone used every '
                  "backend, and together they would overflow it", file=sys.stderr)
            return 2
        return serve_workers(settings, args.workers, host=server.host, port=server.port,
                             config_path=args.config)
    serve(create_app(settings), settings, host=server.host, port=server.port,
          config_path=args.config)
    return 0


def _check(args: argparse.Namespace) -> int:
    settings = _settings(args, _cli_backends(args))
    if args.print:
        text, notes = settings_toml(settings)
        print(text, end="")  # noqa: T201
        for note in notes:
            print(f"gateway: {note}", file=sys.stderr)  # noqa: T201
        return 0
    effective = settings.model_dump(mode="json")
    effective["state"]["redis_url"] = redact_url(settings.state.redis_url)  # no password
    for shown, backend in zip(effective["backends"], settings.backends, strict=True):
        shown["url"] = redact_url(backend.url)
        if backend.kind == "llama.cpp":
            shown["kv_unified"] = backend.unified  # unset means true
        else:
            shown.pop("kv_unified")  # the kind's layout is known: see the note below
    print(json.dumps(effective, indent=2))  # noqa: T201
    for backend in settings.backends:
        if backend.kind == "ollama":
            ctx = (f"ctx_per_slot = {backend.ctx_per_slot}" if backend.ctx_per_slot
                   else "4096 (Ollama's default; set ctx_per_slot)")
            print(f"backend {backend.name}: Ollama shows its parallel count nowhere: slots = "  # noqa: T201
                  f"{backend.slots or 1} (OLLAMA_NUM_PARALLEL); a slot's context is read "
                  f"from /api/ps while a model is loaded, else {ctx}", file=sys.stderr)
        if backend.kind == "vllm":
            print(f"backend {backend.name}: vLLM shows its --max-num-seqs nowhere: slots = "  # noqa: T201
                  f"{backend.slots or 256} ({'configured' if backend.slots else 'vLLM default'})"
                  "; max_model_len is read from /v1/models and the KV pool and block size "
                  "from /metrics", file=sys.stderr)
        if backend.kind == "llama.cpp" and backend.unified:
            print(f"backend {backend.name}: {_unified_note(backend)}",  # noqa: T201
                  file=sys.stderr)
        if backend.api_key is not None:
            source = f"from {backend.api_key_file}" if backend.api_key_file else "inline"
            print(f"backend {backend.name}: an API key ({source}) is sent as "  # noqa: T201
                  "Authorization: Bearer on every upstream call", file=sys.stderr)
    return 0


def _unified_note(b: BackendSettings) -> str:
    """How the gateway reads a unified llama-server layout (``shared/design/backends.md``
    §4.7): the pool is never shown over HTTP."""
    if b.pool_tokens is None:
        return ("kv_unified with no pool_tokens: the pool is taken to be one slot's "
                "context (the safe guess; it is what llama-server allocates without -c). "
                "With --kv-unified-per-slot N, /props shows N as the slot context; set "
                "pool_tokens to -c, or to slots x N when -c is not given.")
    if b.slots and b.ctx_per_slot and b.pool_tokens >= b.slots * b.ctx_per_slot:
        return (f"a pool of {b.pool_tokens} holds all {b.slots} slots of "
                f"{b.ctx_per_slot} at once (as with --kv-unified-per-slot "
                f"{b.ctx_per_slot}): it cannot overflow, and the slots alone bound admission.")
    return (f"slots share a pool of {b.pool_tokens} cells; the gateway admits while the "
            "reservations in flight fit it.")


def _plan(args: argparse.Namespace) -> int:
    import httpx

    from gateway.planner import modelshape
    from gateway.planner.plan import build_report, render_report
    from gateway.planner.planning import parse_bytes
    from gateway.planner.sizing import recommend, render_sizing

    if args.models_dir or args.router:
        return _plan_router(args)
    if args.from_metrics and args.users is None:
        try:
            source = args.from_metrics
            if source.startswith(("http://", "https://")):
                text = httpx.get(source, timeout=10).text
            else:
                text = Path(source).read_text()
            result = recommend(text, margin=args.margin)
        except (httpx.HTTPError, ValueError, OSError) as exc:
            print(f"gateway plan: {exc}", file=sys.stderr)  # noqa: T201
            return 1
        print(json.dumps(result, indent=2) if args.json else render_sizing(result))  # noqa: T201
        return 0
    try:
        shape = None
        if args.gguf:
            shape = modelshape.from_gguf(args.gguf)
        elif args.hf_config:
            shape = modelshape.from_hf_config(args.hf_config)
        elif args.layers and args.kv_heads and args.head_dim:
            shape = modelshape.from_dims(args.layers, args.kv_heads, args.head_dim)
        if args.users is not None:
            return _plan_users(args, shape)
        if shape is None:
            raise ValueError("give --gguf, --hf-config, or --layers/--kv-heads/--head-dim")
        report = build_report(
            shape, type_k=args.cache_type_k, type_v=args.cache_type_v,
            kv_budget=parse_bytes(args.kv_memory) if args.kv_memory else None,
            memory=parse_bytes(args.memory) if args.memory else None,
            ctx=args.ctx, parallel=args.parallel, unified=args.layout == "unified",
        )
    except (ValueError, OSError) as exc:
        print(f"gateway plan: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    print(json.dumps(report, indent=2) if args.json else render_report(report))  # noqa: T201
    return 0


def _plan_router(args: argparse.Namespace) -> int:
    """``gateway plan --models-dir DIR`` or ``--router URL``: a llama-server router's
    models and the memory of ``--models-max`` of them at once
    (:mod:`gateway.planner.routerplan`)."""
    from gateway.planner.planning import parse_bytes
    from gateway.planner.routerplan import (
        DEFAULT_MODELS_MAX,
        model_memory,
        models_in_dir,
        models_of_router,
        render_router_plan,
        router_plan,
    )

    try:
        if args.router:
            listed, most = models_of_router(args.router, args.api_key)
        else:
            common = [*(["--ctx-size", str(args.ctx_size)] if args.ctx_size else []),
                      *(["--parallel", str(args.parallel)] if args.parallel else []),
                      *(["--kv-unified"] if args.layout == "unified" else []),
                      "--cache-type-k", args.cache_type_k, "--cache-type-v", args.cache_type_v]
            listed = [(name, (*found, *common))
                      for name, found in models_in_dir(args.models_dir)]
            most = DEFAULT_MODELS_MAX
        if args.models_max is not None:
            most = args.models_max
        report = router_plan([model_memory(m, a) for m, a in listed], most,
                             parse_bytes(args.memory) if args.memory else None)
    except (ValueError, OSError) as exc:
        print(f"gateway plan: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    print(json.dumps(report, indent=2) if args.json else render_router_plan(report))  # noqa: T201
    return 0


def _plan_users(args: argparse.Namespace, shape: ModelShape | None) -> int:
    """``gateway plan --users N --turn-s S --think-s T``: sizing from users
    (:mod:`gateway.planner.users`); ``shape`` is the model, if one was given."""
    from gateway.planner.planning import parse_bytes
    from gateway.planner.users import UserLoad, render_users, size_from_users

    if args.turn_s is None or args.think_s is None:
        raise ValueError("--users needs --turn-s and --think-s")
    load = UserLoad(args.users, args.turn_s, args.think_s, args.prompt_tokens,
                    args.answer_tokens)
    text = _metrics_text(args.from_metrics) if args.from_metrics else None
    ctx = args.ctx
    running = None if text is None or ctx is not None or args.prompt_tokens is not None \
        else _running_ctx(text)
    report = size_from_users(
        load, headroom=args.headroom, ctx=running or ctx, shape=shape,
        kv_budget=parse_bytes(args.kv_memory) if args.kv_memory else None,
        memory=parse_bytes(args.memory) if args.memory else None,
        unified=args.layout == "unified", type_k=args.cache_type_k, type_v=args.cache_type_v)
    if running:
        report["ctx_source"] = "the running backend's, from its gateway's metrics"
    if text is not None:
        report["latency"] = _learned_latency(text, report)
    print(json.dumps(report, indent=2) if args.json else render_users(report))  # noqa: T201
    return 0


def _metrics_text(source: str) -> str:
    """A gateway's ``/metrics`` text from ``source``, a URL or a file.

    :raises ValueError: it could not be read.
    """
    import httpx

    try:
        if source.startswith(("http://", "https://")):
            return httpx.get(source, timeout=10).text
        return Path(source).read_text()
    except (httpx.HTTPError, OSError) as exc:
        raise ValueError(f"--from-metrics {source}: {exc}") from exc


def _running_ctx(text: str) -> int | None:
    """The largest context per slot of the backends in a gateway's metrics
    (``gateway_backend_ctx_per_slot``), tokens, or ``None``."""
    from prometheus_client.parser import text_string_to_metric_families

    sizes = [int(s.value) for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == "gateway_backend_ctx_per_slot" and s.value > 0]
    return max(sizes, default=None)


def _learned_latency(text: str, report: dict[str, Any]) -> dict[str, Any]:
    """What each backend's learned curve (:mod:`gateway.planner.curve`), read from a
    gateway's ``/metrics`` text, gives the plan's busy slots at the p95 of the load (at
    most its slots)."""
    from gateway.planner.curve import expected, parse_curves

    level = min(report["slots"], report["busy_p95"])
    return {name: expected(curve, max(1, level), report["prompt_tokens"])
            for name, curve in parse_curves(text).items()}


def _probe(args: argparse.Namespace) -> int:
    from gateway.planner.probe import probe, render_probe

    found = probe(args.url, api_key=args.api_key)
    print(json.dumps(found, indent=2) if args.json else render_probe(found))  # noqa: T201
    return 0 if found["kind"] != "unknown" else 1


def _hash_key(args: argparse.Namespace) -> int:
    """Print the SHA-256 of a key read from stdin (never from the command line, where
    it would stay in the shell history); ``--generate`` makes a new key and prints it
    first, then its hash."""
    import getpass
    import secrets

    from gateway.admission.tenants import hash_key

    if args.generate:
        key = "sk-gw-" + secrets.token_urlsafe(32)
        print("line 1: the new key (give it to the client); line 2: its hash (for "  # noqa: T201
              "key_hashes)", file=sys.stderr)
        print(key)  # noqa: T201
    elif sys.stdin.isatty():
        key = getpass.getpass("key: ")
    else:
        key = sys.stdin.readline().rstrip("\r\n")
    if not key.strip():
        print("gateway hash-key: the key is empty", file=sys.stderr)  # noqa: T201
        return 2
    print(hash_key(key.strip()))  # noqa: T201
    return 0


def _backend_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", action="append", metavar="URL[,kind=K][,name=N]",
        help="a backend, in place of the file's [[backends]] (repeatable): its URL, and "
             "optional key=value items after commas (kind, name, model, api_key_file, "
             "slots, ctx_per_slot, kv_unified, pool_tokens); without kind=, the kind is "
             "asked of the server. Give the port: llama-server listens on 8080 by "
             "default, newer builds on 9931")


def _add_router_arguments(plan: argparse.ArgumentParser) -> None:
    """``gateway plan``'s llama-server router (:mod:`gateway.planner.routerplan`)."""
    router = plan.add_argument_group(
        "a llama-server router (docs/router.md): each model, and --models-max at once")
    router.add_argument("--models-dir", metavar="DIR",
                        help="the router's --models-dir: its models, each started with "
                             "--ctx-size, --parallel, --layout and the cache types here")
    router.add_argument("--router", metavar="URL",
                        help="a running router: each model's own arguments from /models")
    router.add_argument("--models-max", type=int,
                        help="models loaded at once (default: the router's, else 4)")
    router.add_argument("--ctx-size", "-c", type=int,
                        help="the router's -c for --models-dir (default: each model's "
                             "trained context)")
    router.add_argument("--api-key", help="the router's --api-key (with --router)")


def _add_users_arguments(plan: argparse.ArgumentParser) -> None:
    """``gateway plan``'s sizing from users (:mod:`gateway.planner.users`)."""
    users = plan.add_argument_group(
        "sizing from users (docs/planner.md: in flight = users x turn-s / think-s)")
    users.add_argument("--users", type=int, help="people using the model")
    users.add_argument("--turn-s", type=float,
                       help="seconds of generation per turn (prefill + answer)")
    users.add_argument("--think-s", type=float,
                       help="seconds from one turn's request to the same user's next, the "
                            "turn included")
    users.add_argument("--prompt-tokens", type=int, help="tokens of a turn's prompt")
    users.add_argument("--answer-tokens", type=int, help="tokens of a turn's answer")
    users.add_argument("--headroom", type=float, default=0.25,
                       help="slots = ceil(in flight x (1 + headroom)); default 0.25")


def _add_health(sub: Any) -> None:
    """The ``gateway health`` command (:func:`_health`)."""
    healthy = sub.add_parser("health", help="exit 0 when the gateway of these settings "
                             "answers /health (a container's health check)")
    healthy.add_argument("--config", help="TOML config file (default: defaults + GATEWAY_* env)")
    healthy.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    healthy.set_defaults(func=_health)


def build_parser() -> argparse.ArgumentParser:
    """The ``gateway`` argument parser."""
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", help="TOML config file (default: defaults + GATEWAY_* env)")
    serve.add_argument("--host", help="listen address (overrides server.host)")
    serve.add_argument("--port", type=int, help="listen port (overrides server.port)")
    serve.add_argument("--workers", type=int, default=1,
                       help='processes serving the one port (N > 1 needs [state] backend '
                            '= "redis"; each has its own server.max_connections)')
    _backend_option(serve)
    serve.set_defaults(func=_serve)
    _add_health(sub)
    check = sub.add_parser("check-config", help="validate a config file and print the result")
    check.add_argument("config", nargs="?",
                       help="TOML config file (default: defaults + GATEWAY_* env)")
    _backend_option(check)
    check.add_argument("--print", action="store_true",
                       help="print the TOML file the settings amount to (the keys given; "
                            "defaults and secrets left out)")
    check.set_defaults(func=_check)

    from gateway.planner.planning import CACHE_TYPES

    plan = sub.add_parser("plan", help="KV-cache calculator and launch settings")
    src = plan.add_argument_group("model (one of)")
    src.add_argument("--gguf", help="GGUF file (metadata only is read)")
    src.add_argument("--hf-config", help="Hugging Face config.json")
    src.add_argument("--layers", type=int)
    src.add_argument("--kv-heads", type=int)
    src.add_argument("--head-dim", type=int)
    plan.add_argument("--cache-type-k", "-ctk", default="f16", choices=sorted(CACHE_TYPES))
    plan.add_argument("--cache-type-v", "-ctv", default="f16", choices=sorted(CACHE_TYPES))
    plan.add_argument("--kv-memory", help="memory for the KV cache, e.g. 6GiB")
    plan.add_argument("--memory", help="total memory; the GGUF file size is taken off for weights")
    plan.add_argument("--ctx", type=int, help="target context per request (tokens)")
    plan.add_argument("--parallel", type=int, help="concurrent requests (slots)")
    plan.add_argument("--layout", choices=["per-slot", "unified"], default="per-slot")
    plan.add_argument("--from-metrics", metavar="URL",
                      help="size from a gateway's /metrics (URL, or a file of its text)")
    plan.add_argument("--margin", type=float, default=0.1,
                      help="safety margin over the p95 (with --from-metrics)")
    _add_users_arguments(plan)
    _add_router_arguments(plan)
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=_plan)
    probe = sub.add_parser("probe", help="detect a backend and read its capacity")
    probe.add_argument("url", help="the server's whole URL, port included (llama-server: "
                                   "8080 by default, 9931 on newer builds; Ollama: 11434)")
    probe.add_argument("--api-key", help="the key the backend was started with (--api-key)")
    probe.add_argument("--json", action="store_true")
    probe.set_defaults(func=_probe)
    hashing = sub.add_parser(
        "hash-key", help="print the SHA-256 of a tenant key read from stdin (for key_hashes)")
    hashing.add_argument("--generate", action="store_true",
                         help="make a new random key; print it, then its hash")
    hashing.set_defaults(func=_hash_key)
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
