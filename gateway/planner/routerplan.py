"""``gateway plan`` for a llama-server router: each model's KV cache and weights, and the
memory that ``--models-max`` models loaded at once can take.

A router (llama-server started without ``-m``) runs each model in a child process of its
own, with its own weights and KV pool, and keeps at most ``--models-max`` children
(default 4) at once, unloading the least recently used idle one past that
(``tools/server/server-models.cpp``). So the memory a router needs is that of its
``--models-max`` largest models together, not of one. The models come from either:

* a models directory, found as llama-server finds them (:func:`models_in_dir`), each
  started with the router's own arguments (``-c``, ``-np``, cache types); or
* a running router's ``GET /models`` (:func:`models_of_router`): each model's child
  arguments, whose ``--model`` GGUF is read here when this machine can read it.

A model's KV cache is :func:`gateway.planner.planning.kv_size` of its launch (``-c`` unset
or 0 is the model's trained context, as llama-server takes it); its weights are its GGUF
files (every shard of a split one, its ``--mmproj`` projector) in bytes. A draft model
(``--spec-draft-model``) adds its weights and a KV cache of the same context (a bound:
``--ctx-size-draft`` may set less).
"""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ModelMemory", "gguf_bytes", "model_memory", "models_in_dir", "models_of_router",
           "render_router_plan", "router_plan"]

MIB = 1024**2
GIB = 1024**3
#: ``--models-max``'s default (``common/arg.cpp``).
DEFAULT_MODELS_MAX = 4
# Companion files llama-server does not load as models of their own (common/preset.cpp:
# "mmproj" anywhere in the name; the draft prefixes).
_DRAFT_PREFIXES = ("mtp-", "dspark-", "dflash-")
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


@dataclass(frozen=True)
class ModelMemory:
    """One model of a router, as planned.

    :param id: the model's name at the router.
    :param gguf: its GGUF path, as the router's arguments give it.
    :param slots: its child's slots; ``ctx_per_slot`` each slot's context (tokens);
        ``n_ctx`` its pool (tokens); ``unified`` whether its slots share it.
    :param kv_bytes: its KV cache, bytes; ``weights_bytes`` its GGUF (and projector)
        files, bytes; either ``None`` when the GGUF cannot be read here.
    :param problem: why it could not be planned, or ``None``.
    """

    id: str
    gguf: str | None
    slots: int | None = None
    ctx_per_slot: int | None = None
    n_ctx: int | None = None
    unified: bool | None = None
    kv_bytes: int | None = None
    weights_bytes: int | None = None
    problem: str | None = None

    @property
    def total_bytes(self) -> int | None:
        """Weights plus KV cache, bytes (``None`` when either is unknown)."""
        if self.kv_bytes is None or self.weights_bytes is None:
            return None
        return self.kv_bytes + self.weights_bytes


def models_in_dir(models_dir: str | Path) -> list[tuple[str, tuple[str, ...]]]:
    """The models a router started with ``--models-dir DIR`` lists, as (name, the
    arguments the router gives its child for them: ``--model`` and, when found,
    ``--mmproj`` and ``--spec-draft-model``), by name: each ``*.gguf`` file at the top
    (named by its stem) and each subdirectory holding one (named by the directory; its
    first shard ``-00001-of-`` if split, a file with ``mmproj`` in its name as the
    projector, the first draft model, ``mtp-``, ``dspark-`` or ``dflash-``, as the draft).
    Projectors and draft models are not models of their own (``common/preset.cpp``,
    ``load_from_models_dir``).

    :raises ValueError: ``models_dir`` is not a directory.
    """
    root = Path(models_dir)
    if not root.is_dir():
        raise ValueError(f"{models_dir} is not a directory")
    found: list[tuple[str, tuple[str, ...]]] = []
    for entry in sorted(root.iterdir()):
        if entry.is_dir():
            files = sorted(p for p in entry.iterdir() if p.is_file() and p.suffix == ".gguf")
            mmproj = next((p for p in files if "mmproj" in p.name), None)
            draft = next((p for p in files if p.name.startswith(_DRAFT_PREFIXES)
                          and "mmproj" not in p.name), None)
            models = [p for p in files if not _companion(p.name)]
            shard = next((p for p in models if "-00001-of-" in p.name), None)
            chosen = shard or (models[-1] if models else None)
            if chosen is not None:
                found.append((entry.name, (
                    "--model", str(chosen), *(("--mmproj", str(mmproj)) if mmproj else ()),
                    *(("--spec-draft-model", str(draft)) if draft else ()))))
        elif entry.is_file() and entry.suffix == ".gguf" and not _companion(entry.name):
            found.append((entry.stem, ("--model", str(entry))))
    return sorted(found)


def _companion(name: str) -> bool:
    """A projector or a draft model's file: loaded with a model, never one of its own."""
    return "mmproj" in name or name.startswith(_DRAFT_PREFIXES)


def gguf_bytes(gguf: str) -> int:
    """Bytes of a model's GGUF: every shard of a split one (``-00001-of-00003.gguf`` and
    its siblings), else the one file."""
    path = Path(gguf)
    match = _SHARD.search(path.name)
    if match is None:
        return path.stat().st_size
    stem, total = path.name[:match.start()], match.group(2)
    return sum(p.stat().st_size for p in path.parent.glob(f"{stem}-*-of-{total}.gguf"))


@functools.lru_cache(maxsize=64)
def _shape_of(path: str) -> Any:
    """A GGUF's :class:`~gateway.planner.planning.ModelShape`, read once per file (its
    metadata read takes seconds; a models directory often names one file twice)."""
    from gateway.planner import modelshape

    return modelshape.from_gguf(path)


def model_memory(model_id: str, args: tuple[str, ...]) -> ModelMemory:
    """Plan one model from its child's arguments (``--model``, ``-c``, ``-np``,
    ``--kv-unified``, ``-ctk``/``-ctv``, ``--mmproj``): its layout as llama-server
    computes it (:func:`gateway.backends.router.child_layout`; ``-c`` unset or 0 is the
    GGUF's trained context) and its memory. A GGUF this machine cannot read leaves the
    row's sizes ``None`` and says why in ``problem``."""
    from gateway.backends.router import child_layout, child_options
    from gateway.planner.planning import kv_size

    opts = child_options(args)
    gguf = opts.get("--model")
    if not gguf:
        return ModelMemory(model_id, None, problem="its arguments name no --model GGUF "
                           "(a Hugging Face repo is downloaded by the router)")
    try:
        shape = _shape_of(str(Path(gguf).resolve()))
    except (OSError, ValueError) as exc:
        return ModelMemory(model_id, gguf, problem=f"its GGUF cannot be read here: {exc}")
    unified, layout = child_layout(args)
    if layout is None:  # -c unset or 0: the trained context
        trained = shape.n_ctx_train or 4096
        unified, layout = child_layout((*args, "--ctx-size", str(trained)))
    if layout is None:
        return ModelMemory(model_id, gguf, problem="its arguments give no context")
    n_ctx = layout.pool_tokens or layout.ctx_per_slot * layout.slots
    types = {"type_k": str(opts.get("--cache-type-k") or "f16"),
             "type_v": str(opts.get("--cache-type-v") or "f16")}
    kv = kv_size(shape, n_ctx, layout.slots, unified=unified, type_k=types["type_k"],
                 type_v=types["type_v"])
    kv_bytes, weights = kv.total_bytes, gguf_bytes(gguf)
    mmproj, draft = opts.get("--mmproj"), opts.get("--spec-draft-model")
    if mmproj:
        with contextlib.suppress(OSError):
            weights += Path(mmproj).stat().st_size
    if draft:  # loaded with the model, with a KV cache of its own at the same context
        try:
            kv_bytes += kv_size(_shape_of(str(Path(draft).resolve())), n_ctx, layout.slots,
                                unified=unified, type_k=types["type_k"],
                                type_v=types["type_v"]).total_bytes
            weights += gguf_bytes(draft)
        except (OSError, ValueError) as exc:
            return ModelMemory(model_id, gguf, problem=f"its draft model cannot be read "
                               f"here: {exc}")
    return ModelMemory(model_id, gguf, slots=layout.slots, ctx_per_slot=kv.n_ctx_seq,
                       n_ctx=kv.n_ctx, unified=unified, kv_bytes=kv_bytes,
                       weights_bytes=weights)


def models_of_router(url: str, api_key: str | None = None,
                     client: Any = None) -> tuple[list[tuple[str, tuple[str, ...]]], int]:
    """A running router's models as (id, child arguments), and its ``--models-max``
    (``/props`` ``max_instances``; 0 when unlimited).

    :raises ValueError: ``url`` cannot be reached, refuses the key, is not a llama-server
        router, or its ``/models`` is not the router's shape.
    """
    import httpx

    from gateway.backends.router import parse_models

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    own = client is None
    client = client or httpx.Client(timeout=10, headers=headers)
    try:
        answers = [client.get(url.rstrip("/") + path) for path in ("/props", "/models")]
    except httpx.HTTPError as exc:
        raise ValueError(f"{url} did not answer /props and /models: {exc}") from exc
    finally:
        if own:
            client.close()
    if any(a.status_code in (401, 403) for a in answers):
        raise ValueError(f"{url} refused the key (HTTP 401/403): give the router's "
                         "--api-key with --api-key")
    try:
        props, listing = (a.json() for a in answers)
    except ValueError as exc:
        raise ValueError(f"{url} answered /props or /models with no JSON: {exc}") from exc
    if not isinstance(props, dict) or props.get("role") != "router":
        raise ValueError(f"{url} is not a llama-server router (its /props has no "
                         "role: router)")
    entries = parse_models(listing)
    most = props.get("max_instances")
    return ([(e.id, e.args) for e in entries.values()],
            most if isinstance(most, int) and most > 0 else 0)


def router_plan(models: list[ModelMemory], models_max: int, memory: int | None = None
                ) -> dict[str, Any]:
    """The plan of a router's models (the ``--json`` output): each model's row, the
    memory of the ``models_max`` largest at once (0: every model), and, given
    ``memory`` (bytes), whether that fits and the most models that always fit.

    :returns: ``models`` (rows), ``models_max``, ``resident`` (the ids of the largest
        ``models_max``), ``resident_bytes``, ``unknown`` (ids not planned), and with
        ``memory`` also ``memory_bytes``, ``fits`` and ``models_max_that_fits``.
    """
    known = sorted((m for m in models if m.total_bytes is not None),
                   key=lambda m: (-(m.total_bytes or 0), m.id))
    at_once = len(known) if models_max <= 0 else min(models_max, len(known))
    resident = known[:at_once]
    report: dict[str, Any] = {
        "models": [{"id": m.id, "gguf": m.gguf, "slots": m.slots,
                    "ctx_per_slot": m.ctx_per_slot, "n_ctx": m.n_ctx, "unified": m.unified,
                    "kv_bytes": m.kv_bytes, "weights_bytes": m.weights_bytes,
                    "total_bytes": m.total_bytes, "problem": m.problem} for m in models],
        "models_max": models_max,
        "resident": [m.id for m in resident],
        "resident_bytes": sum(m.total_bytes or 0 for m in resident),
        "unknown": [m.id for m in models if m.total_bytes is None],
    }
    if memory is not None:
        fitting, used = 0, 0
        for m in known:  # the largest first: any n of them take at most this much
            used += m.total_bytes or 0
            if used > memory:
                break
            fitting += 1
        report.update(memory_bytes=memory, fits=report["resident_bytes"] <= memory,
                      models_max_that_fits=fitting)
    return report


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.2f} MiB"


def render_router_plan(report: dict[str, Any]) -> str:
    """The router plan as text for people."""
    lines = [f"{'model':<28} {'slots':>5} {'ctx/slot':>9} {'n_ctx':>8} {'pool':>9} "
             f"{'KV':>11} {'weights':>11} {'total':>11}"]
    for m in report["models"]:
        if m["problem"]:
            lines.append(f"{m['id']:<28} not planned: {m['problem']}")
            continue
        pool = "unified" if m["unified"] else "per-slot"
        lines.append(f"{m['id']:<28} {m['slots']:>5} {m['ctx_per_slot']:>9} "
                     f"{m['n_ctx']:>8} {pool:>9} {_size(m['kv_bytes']):>11} "
                     f"{_size(m['weights_bytes']):>11} {_size(m['total_bytes']):>11}")
    most = report["models_max"]
    lines += ["", f"--models-max   {most if most > 0 else 'unlimited'}: at most "
              f"{len(report['resident'])} model(s) loaded at once"]
    lines.append(f"at once        {_size(report['resident_bytes'])} (the largest: "
                 f"{', '.join(report['resident']) or 'none'})")
    if "memory_bytes" in report:
        verdict = "fits" if report["fits"] else "does NOT fit"
        most_fit = report["models_max_that_fits"]
        advice = (f"any {most_fit} of these models fit at once (--models-max {most_fit} "
                  "or less)" if most_fit else "not even the largest model fits alone")
        lines.append(f"memory         {_size(report['memory_bytes'])}: {verdict}; {advice}")
    if report["unknown"]:
        lines.append(f"not counted    {', '.join(report['unknown'])}: plan them with "
                     "gateway plan --gguf on a machine that has their files")
    lines += ["", "Memory here is weights + KV cache; compute buffers and the projector's "
              "work area come on top (a few hundred MiB per child)."]
    return "\n".join(lines)
