"""``gateway plan``: turn a model's shape and a memory budget into launch settings.

Builds a report (a plain dict, also the ``--json`` output) from the pure arithmetic in
:mod:`gateway.planner.planning`, and renders it as text for people.
"""

from __future__ import annotations

import math
from typing import Any

from gateway.planner.planning import (
    CTX_ALIGN,
    ModelShape,
    SlotOption,
    bytes_per_token,
    kv_size,
    max_ctx_for_slots,
    max_slots_for_ctx,
)

__all__ = ["build_report", "render_report"]

MIB = 1024**2
GIB = 1024**3
_OLLAMA_TYPES = {"f16", "q8_0", "q4_0"}  # OLLAMA_KV_CACHE_TYPE values


def _option_row(opt: SlotOption, unified: bool) -> dict[str, Any]:
    """``ctx_each``: tokens each slot can hold when all slots are busy at once;
    ``ctx_per_slot``: the slot context llama-server reports (the whole pool if unified)."""
    return {
        "slots": opt.slots, "ctx_each": opt.kv.n_ctx // opt.slots,
        "ctx_per_slot": opt.ctx_per_slot, "n_ctx": opt.kv.n_ctx,
        "kv_bytes": opt.kv.total_bytes, "unified": unified,
    }


def _launch(opt: SlotOption, unified: bool, type_k: str, type_v: str, shape: ModelShape,
            memory: int | None, name: str) -> dict[str, Any]:
    flags = ["-c", str(opt.kv.n_ctx), "-np", str(opt.slots),
             "--kv-unified" if unified else "--no-kv-unified"]
    if (type_k, type_v) != ("f16", "f16"):
        flags += ["-ctk", type_k, "-ctv", type_v]
    if type_v not in ("f16", "bf16", "f32"):
        flags += ["-fa", "on"]  # a quantized V cache needs flash attention
    # Ollama has no shared pool: it launches llama-server with -c NumCtx*NumParallel
    # -np NumParallel (llm/llama_server.go), so each slot gets OLLAMA_CONTEXT_LENGTH cells
    # of its own. Its line is per-slot with the plan's memory split evenly; a unified plan's
    # whole pool there would allocate slots x the memory budgeted.
    per_slot = max(CTX_ALIGN, opt.kv.n_ctx // opt.slots // CTX_ALIGN * CTX_ALIGN)
    ollama = {"OLLAMA_NUM_PARALLEL": str(opt.slots), "OLLAMA_CONTEXT_LENGTH": str(per_slot)}
    ollama_note = None
    if unified and opt.slots > 1:
        ollama_note = (f"Ollama gives each slot its own context: {per_slot} each is this "
                       f"plan's memory; no request there can use the whole {opt.kv.n_ctx}")
    if type_k != "f16" or type_v != "f16":
        if type_k == type_v and type_k in _OLLAMA_TYPES:
            ollama["OLLAMA_KV_CACHE_TYPE"] = type_k
            ollama["OLLAMA_FLASH_ATTENTION"] = "1"
        else:
            ollama_note = "Ollama sets one type for K and V: f16, q8_0 or q4_0"
    # --port 8001: vLLM's default port, 8000, is also the gateway's.
    vllm = ["--max-model-len", str(opt.ctx_per_slot), "--max-num-seqs", str(opt.slots),
            "--port", "8001"]
    vllm_note = "vLLM pages KV in blocks; sizes from llama.cpp cache types are approximate"
    if memory and shape.weights_bytes:
        util = min(0.95, math.ceil((shape.weights_bytes + opt.kv.total_bytes) / memory * 100
                                   + 5) / 100)
        vllm += ["--gpu-memory-utilization", f"{util:.2f}"]
    vllm_block = "\n".join([
        "[[backends]]", f'name = "{name}"', 'url = "http://127.0.0.1:8001"', 'kind = "vllm"',
        f"slots = {opt.slots}   # --max-num-seqs; max_model_len and the pool are discovered",
    ])
    gateway_block = [
        "[[backends]]", f'name = "{name}"', 'url = "http://127.0.0.1:8080"', 'kind = "llama.cpp"',
        f"slots = {opt.slots}", f"ctx_per_slot = {opt.ctx_per_slot}",
        f"kv_unified = {'true' if unified else 'false'}",
    ]
    capped: dict[str, str] | None = None
    if unified:
        gateway_block.append(f"pool_tokens = {opt.kv.n_ctx}")
        if opt.slots > 1:
            capped = _capped_launch(opt, flags, name)
    return {
        "llama_server": "llama-server -m MODEL.gguf " + " ".join(flags),
        "llama_server_capped": capped,
        "ollama_env": ollama, "ollama_note": ollama_note,
        "vllm": "vllm serve MODEL " + " ".join(vllm), "vllm_note": vllm_note,
        "vllm_gateway": vllm_block,
        "gateway": "\n".join(gateway_block),
    }


def _capped_launch(opt: SlotOption, flags: list[str], name: str) -> dict[str, str]:
    """The same unified pool with every slot capped at pool / slots
    (``--kv-unified-per-slot N``, ``tools/server/server-context.cpp``): no mix of requests
    can overflow the pool, even one that bypasses the gateway, at the price of no request
    using more than N tokens. llama-server's ``/props`` then shows N as the slot context
    and the pool is invisible, hence ``pool_tokens`` in the block."""
    cap = opt.kv.n_ctx // opt.slots
    block = [
        "[[backends]]", f'name = "{name}"', 'url = "http://127.0.0.1:8080"',
        'kind = "llama.cpp"', f"slots = {opt.slots}", f"ctx_per_slot = {cap}",
        "kv_unified = true", f"pool_tokens = {opt.kv.n_ctx}",
    ]
    return {
        "llama_server": "llama-server -m MODEL.gguf " + " ".join(flags)
        + f" --kv-unified-per-slot {cap}",
        "note": f"each slot capped at {cap} tokens: safe without the gateway too, but no "
                f"request can use the whole pool of {opt.kv.n_ctx}",
        "gateway": "\n".join(block),
    }


def build_report(
    shape: ModelShape, *, type_k: str = "f16", type_v: str = "f16",
    kv_budget: int | None = None, memory: int | None = None, ctx: int | None = None,
    parallel: int | None = None, unified: bool = False,
) -> dict[str, Any]:
    """Compute the plan.

    :param kv_budget: bytes for KV; when ``None`` and ``memory`` is given, memory minus the
        weights file.
    :param ctx: target context per request (tokens); ``parallel``: concurrent requests.
    :raises ValueError: no budget and not both ``ctx`` and ``parallel``, or a budget too
        small for any option.
    """
    if kv_budget is None and memory is not None:
        if shape.weights_bytes is None:
            raise ValueError("--memory needs a GGUF file (its size is the weights); "
                             "use --kv-memory instead")
        kv_budget = memory - shape.weights_bytes
        if kv_budget <= 0:
            raise ValueError("the weights alone fill the memory given")
    full_tok, swa_tok = bytes_per_token(shape, type_k, type_v)
    report: dict[str, Any] = {
        "model": {
            "name": shape.name, "layers": shape.n_layer,
            "kv_heads": sorted(set(shape.n_head_kv)), "head_k": shape.head_k,
            "head_v": shape.head_v, "swa_layers": len(shape.swa_layers),
            "sliding_window": shape.n_swa, "n_ctx_train": shape.n_ctx_train,
            "weights_bytes": shape.weights_bytes,
        },
        "cache_type_k": type_k, "cache_type_v": type_v, "layout": "unified" if unified
        else "per-slot",
        "kv_bytes_per_token": full_tok, "kv_bytes_per_token_swa_layers": swa_tok,
        "kv_budget_bytes": kv_budget,
    }
    chosen: SlotOption | None
    if ctx and parallel:
        kv = kv_size(shape, ctx * parallel, parallel, unified=unified, type_k=type_k,
                     type_v=type_v)
        chosen = SlotOption(parallel, kv.n_ctx_seq, kv)
        if kv_budget is not None and kv.total_bytes > kv_budget:
            report["warning"] = (f"{parallel} x {ctx} needs {kv.total_bytes / MIB:.2f} MiB of "
                                 f"KV, more than the budget of {kv_budget / MIB:.2f} MiB")
    elif kv_budget is None:
        raise ValueError("give --kv-memory or --memory, or both --ctx and --parallel")
    elif ctx:
        chosen = max_slots_for_ctx(shape, kv_budget, ctx, unified=unified, type_k=type_k,
                                   type_v=type_v)
    else:
        chosen = max_ctx_for_slots(shape, kv_budget, parallel or 1, unified=unified,
                                   type_k=type_k, type_v=type_v)
    if chosen is None:
        raise ValueError("the KV budget does not hold even one slot of 256 tokens")
    if kv_budget is not None:
        report["tokens_that_fit"] = kv_budget // full_tok if full_tok else None
        options = []
        for slots in (1, 2, 4, 8, 16, 32):
            opt = max_ctx_for_slots(shape, kv_budget, slots, unified=unified, type_k=type_k,
                                    type_v=type_v)
            if opt is not None:
                options.append(_option_row(opt, unified))
        report["options"] = options
    report["chosen"] = _option_row(chosen, unified)
    report["chosen"]["kv_full_bytes"] = chosen.kv.full_bytes
    report["chosen"]["kv_swa_bytes"] = chosen.kv.swa_bytes
    report["launch"] = _launch(chosen, unified, type_k, type_v, shape, memory, "local")
    return report


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:,.2f} MiB"


def render_report(r: dict[str, Any]) -> str:
    """The report as text for a terminal."""
    m = r["model"]
    lines = [
        f"model          {m['name']}: {m['layers']} layers, KV heads {m['kv_heads']}, "
        f"head K/V {m['head_k']}/{m['head_v']}"
        + (f", {m['swa_layers']} sliding-window layers (window {m['sliding_window']})"
           if m["swa_layers"] else "")
        + (f", trained context {m['n_ctx_train']}" if m["n_ctx_train"] else ""),
        f"cache types    K {r['cache_type_k']}, V {r['cache_type_v']}; layout {r['layout']}",
        f"KV per token   {r['kv_bytes_per_token']:,} bytes"
        + (f" (+ {r['kv_bytes_per_token_swa_layers']:,} bytes in sliding-window layers, "
           "which stop growing at the window)" if r["kv_bytes_per_token_swa_layers"] else ""),
    ]
    if r.get("kv_budget_bytes") is not None:
        lines.append(f"KV budget      {_mib(r['kv_budget_bytes'])}"
                     f" -> about {r['tokens_that_fit']:,} tokens of full-attention KV")
        lines += ["", "  slots  ctx each, all busy  slot n_ctx     n_ctx        KV size"]
        for o in r["options"]:
            lines.append(f"  {o['slots']:>5}  {o['ctx_each']:>18}  {o['ctx_per_slot']:>10}  "
                         f"{o['n_ctx']:>8}  {_mib(o['kv_bytes']):>13}")
    c = r["chosen"]
    shape = (f"{c['slots']} slot(s) sharing a pool of {c['n_ctx']} cells ({c['ctx_each']} "
             f"each when all are busy)" if c["unified"] else
             f"{c['slots']} slot(s) x {c['ctx_per_slot']} tokens (n_ctx {c['n_ctx']})")
    lines += [
        "",
        f"chosen         {shape}: KV {_mib(c['kv_bytes'])} = {_mib(c['kv_full_bytes'])} full"
        f" + {_mib(c['kv_swa_bytes'])} sliding-window",
    ]
    if "warning" in r:
        lines.append(f"WARNING        {r['warning']}")
    launch = r["launch"]
    lines += ["", "llama-server   " + launch["llama_server"],
              "Ollama         " + " ".join(f"{k}={v}" for k, v in launch["ollama_env"].items())
              + " ollama serve"]
    if launch["ollama_note"]:
        lines.append("               (" + launch["ollama_note"] + ")")
    lines += ["vLLM           " + launch["vllm"], "               (" + launch["vllm_note"] + ")",
              "", "gateway config, in front of llama-server:", launch["gateway"]]
    capped = launch.get("llama_server_capped")
    if capped:
        lines += ["", "or llama-server with each slot capped, safe for traffic that bypasses "
                  "the gateway too:", "llama-server   " + capped["llama_server"],
                  "               (" + capped["note"] + ")", "",
                  "gateway config, in front of that llama-server:", capped["gateway"]]
    lines += ["", "gateway config, in front of vLLM:", launch["vllm_gateway"]]
    return "\n".join(lines)
