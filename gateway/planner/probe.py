"""``gateway probe URL``: find out what kind of server is at URL and what it exposes.

* llama-server: ``GET /props`` (``total_slots``, ``default_generation_settings.n_ctx``),
  ``GET /slots`` (per-slot ``n_ctx``), ``GET /v1/models`` (``meta.n_ctx_train``).
* llama-server as a router (``/props`` ``role: router``): ``GET /models`` (each model's
  ``status.value`` and child arguments) and ``GET /props?model=ID&autoload=false`` for
  the models that run; see :mod:`gateway.backends.router` and ``docs/router.md``.
* Ollama: ``GET /api/version``, ``GET /api/ps`` (loaded models with ``context_length``),
  ``POST /api/show`` (``model_info``).
* vLLM: ``GET /v1/models`` (``owned_by: "vllm"``, ``max_model_len``) and ``GET /metrics``
  (``vllm:cache_config_info`` labels ``block_size``/``num_gpu_blocks``, and
  ``kv_cache_size_tokens`` where exported).

Sources: ``shared/design/backends.md`` §1.4, §2, §3.
"""

from __future__ import annotations

from typing import Any

import httpx

from gateway.wire.builds import SURVEY, BuildReport, read_survey

__all__ = ["probe", "render_probe"]


def _json(client: httpx.Client, method: str, url: str, **kw: Any) -> Any:
    try:
        resp = client.request(method, url, **kw)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        return resp.json()
    except ValueError:
        return None


def _survey(client: httpx.Client, url: str) -> BuildReport:
    """The build survey (:mod:`gateway.wire.builds`) the gateway runs at discovery."""
    status: dict[str, int | None] = {}
    for _, path, body in SURVEY:
        try:
            status[path] = (client.get(url + path) if body is None
                            else client.post(url + path, json=body)).status_code
        except httpx.HTTPError:
            status[path] = None
    return read_survey(status)


def _llama(client: httpx.Client, url: str, props: dict[str, Any]) -> dict[str, Any]:
    slots_json = _json(client, "GET", url + "/slots")
    models = _json(client, "GET", url + "/v1/models") or {}
    meta = ((models.get("data") or [{}])[0] or {}).get("meta") or {}
    slots = int(props["total_slots"])
    ctx = int(props["default_generation_settings"]["n_ctx"])
    found: dict[str, Any] = {
        "kind": "llama.cpp", "slots": slots, "ctx_per_slot": ctx,
        "n_ctx_train": meta.get("n_ctx_train"), "model": props.get("model_alias")
        or props.get("model_path"),
        "busy_slots": sum(bool(s.get("is_processing")) for s in slots_json)
        if isinstance(slots_json, list) else None,
    }
    report = _survey(client, url)
    found["fallbacks"], found["problem"] = list(report.fallbacks), report.problem
    found["undiscoverable"] = [
        "kv_unified: whether the slots share one KV pool (llama-server's default without "
        "-np) or each has its own (-np N); /props and /slots look the same either way",
        f"pool_tokens: the unified pool size (-c); {ctx} per slot is all that is visible",
        f"--kv-unified-per-slot N: /props then shows N ({ctx} here) as the slot context; "
        f"the pool is -c, or slots x N = {slots * ctx} without -c, and a slot can never "
        "use more than N, so the pool cannot overflow even for traffic that bypasses the "
        "gateway",
    ]
    found["backend_block"] = "\n".join([
        "[[backends]]", 'name = "local"', f'url = "{url}"', 'kind = "llama.cpp"',
        f"# slots = {slots}   # discovered from /props; set only to narrow it",
        f"# ctx_per_slot = {ctx}   # discovered from /props; set only to narrow it",
        "kv_unified = true   # set false if llama-server runs with -np N (no --kv-unified)",
        *(['api_key = "..."   # the key given to llama-server --api-key']
          if client.headers.get("authorization") else []),
        "# pool_tokens = N   # the -c value, when unified and larger than one slot's "
        f"{ctx}",
        f"# pool_tokens = {slots * ctx}   # with --kv-unified-per-slot {ctx} and no -c",
    ])
    return found


def _router_model(client: httpx.Client, url: str, entry: Any) -> dict[str, Any]:
    """One model of a router: its state and layout (from ``/props?model=`` while it
    runs, else from its child's arguments)."""
    from urllib.parse import urlencode

    from gateway.backends.router import child_layout

    unified, derived = child_layout(entry.args)
    row: dict[str, Any] = {"id": entry.id, "state": entry.state, "kv_unified": unified,
                           "slots": None, "ctx_per_slot": None, "pool_tokens": None,
                           "from": None}
    if derived is not None:
        row.update(slots=derived.slots, ctx_per_slot=derived.ctx_per_slot,
                   pool_tokens=derived.pool_tokens, **{"from": "arguments"})
    if entry.running and entry.status != "loading":
        query = urlencode({"model": entry.id, "autoload": "false"})
        props = _json(client, "GET", f"{url}/props?{query}")
        if isinstance(props, dict) and "total_slots" in props:
            ctx = int(props["default_generation_settings"]["n_ctx"])
            row.update(slots=int(props["total_slots"]), ctx_per_slot=ctx,
                       **{"from": "props"})
            if unified and row["pool_tokens"] is None:
                row["pool_tokens"] = ctx
    return row


def _router(client: httpx.Client, url: str, props: dict[str, Any]) -> dict[str, Any]:
    """A llama-server router: each model's state and layout, and ``--models-max``."""
    from gateway.backends.router import parse_models

    try:
        entries = parse_models(_json(client, "GET", url + "/models"))
    except ValueError:
        entries = {}
    rows = [_router_model(client, url, e) for e in entries.values()]
    most = props.get("max_instances") if isinstance(props.get("max_instances"), int) else 0
    return {
        "kind": "llama.cpp", "role": "router", "max_instances": most or None,
        "models_autoload": props.get("models_autoload") is not False, "models": rows,
        "undiscoverable": [
            "a model never loaded whose arguments set no -c shows no context until it "
            "loads: the gateway loads it on the first request for it, then knows it",
            f"--models-max {most or 'unlimited'}: that many models' weights and KV pools "
            "are in memory at once; plan memory for the largest ones (gateway plan, one "
            "model at a time)",
            "the training context caps a slot; a model's layout from its arguments is "
            "corrected by its /props once it has loaded",
        ],
        "backend_block": "\n".join([
            "[[backends]]", 'name = "router"', f'url = "{url}"', 'kind = "llama.cpp"',
            "# a llama-server router: each model is a backend of its own, named "
            '"router/<model>", serving its id; layouts are discovered per model',
            *(['api_key = "..."   # the key given to llama-server --api-key']
              if client.headers.get("authorization") else []),
        ]),
    }


def _ollama(client: httpx.Client, url: str, version: dict[str, Any]) -> dict[str, Any]:
    ps = _json(client, "GET", url + "/api/ps") or {}
    loaded = []
    for m in ps.get("models") or []:
        show = _json(client, "POST", url + "/api/show", json={"model": m.get("name")}) or {}
        info = show.get("model_info") or {}
        arch = info.get("general.architecture")
        loaded.append({
            "name": m.get("name"), "context_length": m.get("context_length"),
            "size_vram": m.get("size_vram"),
            "declared_context": info.get(f"{arch}.context_length") if arch else None,
        })
    ctx = loaded[0]["context_length"] if loaded else None
    return {
        "kind": "ollama", "version": version.get("version"), "loaded_models": loaded,
        "ctx_per_slot": ctx, "slots": None,
        "undiscoverable": [
            "OLLAMA_NUM_PARALLEL (slots per model; default 1 since v0.9.7) is not exposed",
            "context_length is the loaded per-slot context, which can be far below the "
            "model's declared length",
        ],
        "backend_block": "\n".join([
            "[[backends]]", 'name = "ollama"', f'url = "{url}"',
            'kind = "ollama"',
            "slots = 1         # OLLAMA_NUM_PARALLEL", f"ctx_per_slot = {ctx or 4096}",
        ]),
    }


def _vllm(client: httpx.Client, url: str, models: dict[str, Any]) -> dict[str, Any]:
    from gateway.backends.vllm import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_SEQS, parse_metrics

    model = models["data"][0]
    found: dict[str, Any] = {"kind": "vllm", "model": model.get("id"),
                             "max_model_len": model.get("max_model_len"), "slots": None}
    try:
        found.update(parse_metrics(client.get(url + "/metrics").text))
    except (httpx.HTTPError, ValueError):
        pass
    block = found.get("block_size") or DEFAULT_BLOCK_SIZE
    pool = found.get("kv_cache_size_tokens") or (
        block * found["num_gpu_blocks"] if found.get("num_gpu_blocks") else None)
    found["pool_tokens"] = pool
    found["undiscoverable"] = [
        f"--max-num-seqs (concurrent sequences) is not exposed; vLLM's default is "
        f"{DEFAULT_MAX_NUM_SEQS} (1024 on the largest GPUs)",
        *([] if pool else ["the KV pool: /metrics shows no vllm:cache_config_info; set "
                           "pool_tokens to the 'GPU KV cache size' of vLLM's startup log"]),
    ]
    found["backend_block"] = "\n".join([
        "[[backends]]", 'name = "vllm"', f'url = "{url}"', 'kind = "vllm"',
        f"slots = {DEFAULT_MAX_NUM_SEQS}   # --max-num-seqs (vLLM's default on most GPUs)",
        f"# ctx_per_slot = {found['max_model_len']}   # max_model_len, read from /v1/models",
        f"# pool_tokens = {pool}   # read from /metrics" if pool else
        "# pool_tokens = N   # the 'GPU KV cache size' of vLLM's log; unset, the gateway "
        "admits one max_model_len at a time",
    ])
    return found


def probe(url: str, client: httpx.Client | None = None, api_key: str | None = None
          ) -> dict[str, Any]:
    """Detect the server kind at ``url`` and read its capacity.

    :param api_key: sent as ``Authorization: Bearer`` (llama-server ``--api-key``).
    :returns: a dict with ``kind`` (``llama.cpp``, ``ollama``, ``vllm`` or ``unknown``),
        the values found, ``undiscoverable`` notes and a ``backend_block`` for the config;
        a llama-server router has ``role: "router"``, ``max_instances`` and ``models``
        (each model's id, state and layout).
    """
    url = url.rstrip("/")
    own = client is None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = client or httpx.Client(timeout=10, headers=headers)
    try:
        try:
            status = client.get(url + "/props").status_code
        except httpx.HTTPError:
            status = None
        if status in (401, 403):
            given = "was refused" if api_key else "is needed"
            return {"kind": "unknown", "error": (
                f"{url} answered HTTP {status} to /props: an API key {given} (llama-server "
                "started with --api-key). Pass --api-key KEY here, and set api_key or "
                "api_key_file in the [[backends]] entry.")}
        props = _json(client, "GET", url + "/props")
        if isinstance(props, dict) and props.get("role") == "router":
            return _router(client, url, props)
        if isinstance(props, dict) and "total_slots" in props:
            return _llama(client, url, props)
        version = _json(client, "GET", url + "/api/version")
        if isinstance(version, dict) and "version" in version:
            return _ollama(client, url, version)
        models = _json(client, "GET", url + "/v1/models")
        if isinstance(models, dict) and (models.get("data") or [{}])[0].get("owned_by") == "vllm":
            return _vllm(client, url, models)
        health = None
        try:
            health = client.get(url + "/health").status_code
        except httpx.HTTPError as exc:
            return {"kind": "unknown", "error": f"cannot reach {url}: {exc}"}
        return {"kind": "unknown", "error": f"{url} answered /health with {health} but none "
                "of the llama-server, Ollama or vLLM discovery endpoints"}
    finally:
        if own:
            client.close()


def render_probe(found: dict[str, Any]) -> str:
    """The probe result as text."""
    if found["kind"] == "unknown":
        return f"unknown backend: {found['error']}"
    lines = [f"kind           {found['kind']}"]
    for key, value in found.items():
        if key in ("kind", "undiscoverable", "backend_block", "models", "fallbacks",
                   "problem") or value is None:
            continue
        lines.append(f"{key:<14} {value}")
    for model in found.get("models") or []:
        layout = ("layout unknown until loaded" if model["slots"] is None else
                  f"{model['slots']} slots x {model['ctx_per_slot']} tokens, " + (
                      f"unified pool {model['pool_tokens']}" if model["kv_unified"]
                      else "per-slot KV") + f" (from {model['from']})")
        lines.append(f"model          {model['id']}: {model['state']}, {layout}")
    if found.get("problem"):
        lines += ["", f"the gateway will not use this server: {found['problem']}"]
    if found.get("fallbacks"):
        lines += ["", "this build lacks (what the gateway does instead):"]
        lines += [f"  - {note}" for note in found["fallbacks"]]
    lines.append("")
    lines.append("not discoverable over HTTP (set in config):")
    lines += [f"  - {note}" for note in found["undiscoverable"]]
    lines += ["", found["backend_block"]]
    return "\n".join(lines)
