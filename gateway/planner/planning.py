"""KV-cache arithmetic for llama.cpp-style caches: bytes per token, totals, sizing options.

Pure functions, no I/O. Sources (llama.cpp build 11434, ``shared/design/backends.md`` §1.6):

* bytes of ``n`` values of a cache type: ``n / block × type_size`` (``ggml-common.h``):
  f32 4/1, f16 and bf16 2/1, q8_0 34/32, q4_0 and iq4_nl 18/32, q4_1 20/32, q5_0 22/32,
  q5_1 24/32;
* per layer with its own KV: ``K = rs(type_k, head_k × n_head_kv)``,
  ``V = rs(type_v, head_v × n_head_kv)`` (``llama-kv-cache.cpp``);
* ``n_ctx`` is rounded up to a multiple of 256; without a unified cache each of
  ``n_seq`` streams gets ``n_ctx_seq = pad(n_ctx / n_seq, 256)`` (``llama-context.cpp``);
* full-attention layers hold ``n_ctx`` cells in all; sliding-window layers hold
  ``size_swa = pad(min(n_ctx_seq, n_swa × (n_seq if unified else 1) + n_ubatch), 256)``
  cells per stream (``llama-kv-cache-iswa.cpp``), so only full layers grow with context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "CACHE_TYPES",
    "KvSize",
    "ModelShape",
    "SlotOption",
    "bytes_per_token",
    "kv_size",
    "max_ctx_for_slots",
    "max_slots_for_ctx",
    "pad",
    "parse_bytes",
    "row_bytes",
]

# type -> (values per block, bytes per block)
CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
    "q4_1": (32, 20), "iq4_nl": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24),
}
N_UBATCH = 512  # llama.cpp default -ub
CTX_ALIGN = 256


def pad(value: int, multiple: int) -> int:
    """Round ``value`` up to a multiple of ``multiple`` (llama.cpp ``GGML_PAD``)."""
    return (value + multiple - 1) // multiple * multiple


def row_bytes(cache_type: str, values: int) -> int:
    """Bytes for ``values`` numbers of ``cache_type``.

    :raises ValueError: unknown type, or ``values`` not a whole number of blocks.
    """
    if cache_type not in CACHE_TYPES:
        raise ValueError(f"unknown cache type {cache_type!r}; one of {', '.join(CACHE_TYPES)}")
    block, size = CACHE_TYPES[cache_type]
    if values % block:
        raise ValueError(f"{values} values are not whole {cache_type} blocks of {block}")
    return values // block * size


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache of a model depends on.

    :param n_head_kv: KV heads per layer (one entry per layer; 0 = the layer has no KV).
    :param head_k: key width per head; ``head_v`` value width per head.
    :param swa_layers: indices of sliding-window layers; ``n_swa`` their window (tokens).
    :param has_v: False for MLA-style caches that store K only.
    """

    name: str
    n_head_kv: tuple[int, ...]
    head_k: int
    head_v: int
    swa_layers: frozenset[int] = field(default_factory=frozenset)
    n_swa: int = 0
    n_ctx_train: int | None = None
    weights_bytes: int | None = None
    has_v: bool = True

    @property
    def n_layer(self) -> int:
        return len(self.n_head_kv)


def bytes_per_token(shape: ModelShape, type_k: str = "f16", type_v: str = "f16") -> tuple[int, int]:
    """KV bytes per token: (full-attention layers, sliding-window layers)."""
    full = swa = 0
    for layer, heads in enumerate(shape.n_head_kv):
        if heads == 0:
            continue
        size = row_bytes(type_k, shape.head_k * heads)
        if shape.has_v:
            size += row_bytes(type_v, shape.head_v * heads)
        if layer in shape.swa_layers:
            swa += size
        else:
            full += size
    return full, swa


@dataclass(frozen=True)
class KvSize:
    """The KV cache llama.cpp allocates for one launch.

    :param n_ctx: total cells after rounding; ``n_ctx_seq`` the context of one slot.
    :param full_bytes: full-attention layers; ``swa_bytes`` sliding-window layers.
    """

    n_ctx: int
    n_ctx_seq: int
    n_seq: int
    unified: bool
    size_swa: int
    full_bytes: int
    swa_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.full_bytes + self.swa_bytes


def kv_size(
    shape: ModelShape, n_ctx: int, n_seq: int, *, unified: bool, type_k: str = "f16",
    type_v: str = "f16", n_ubatch: int = N_UBATCH, swa_full: bool = False,
) -> KvSize:
    """The KV cache of a launch ``-c n_ctx -np n_seq`` (``--kv-unified`` or not), in bytes."""
    n_ctx = pad(n_ctx, CTX_ALIGN)
    if unified:
        n_ctx_seq, streams = n_ctx, 1
    else:
        n_ctx_seq = pad(n_ctx // n_seq, CTX_ALIGN)
        n_ctx, streams = n_ctx_seq * n_seq, n_seq
    if shape.n_ctx_train:
        n_ctx_seq_slot = min(n_ctx_seq, shape.n_ctx_train)
    else:
        n_ctx_seq_slot = n_ctx_seq
    full_tok, swa_tok = bytes_per_token(shape, type_k, type_v)
    if swa_full or not shape.swa_layers:
        size_swa = n_ctx_seq
    else:
        size_swa = pad(min(n_ctx_seq, shape.n_swa * (n_seq if unified else 1) + n_ubatch),
                       CTX_ALIGN)
    return KvSize(
        n_ctx=n_ctx, n_ctx_seq=n_ctx_seq_slot, n_seq=n_seq, unified=unified, size_swa=size_swa,
        full_bytes=n_ctx * full_tok, swa_bytes=streams * size_swa * swa_tok,
    )


@dataclass(frozen=True)
class SlotOption:
    """One way to spend a KV budget: ``slots`` × ``ctx_per_slot`` (tokens), its bytes."""

    slots: int
    ctx_per_slot: int
    kv: KvSize


def max_ctx_for_slots(
    shape: ModelShape, budget_bytes: int, slots: int, *, unified: bool, type_k: str = "f16",
    type_v: str = "f16",
) -> SlotOption | None:
    """The largest per-slot context (multiple of 256) for ``slots`` that fits the budget.

    Unified layouts get a pool of ``slots × ctx``, so that every slot can hold a full
    context at once. Capped at the model's training context. ``None`` if not even 256.
    """
    limit = shape.n_ctx_train or 1 << 20
    best = None
    lo, hi = 1, limit // CTX_ALIGN
    while lo <= hi:  # kv_size grows monotonically with the context
        mid = (lo + hi) // 2
        ctx = mid * CTX_ALIGN
        kv = kv_size(shape, ctx * slots, slots, unified=unified, type_k=type_k, type_v=type_v)
        if kv.total_bytes <= budget_bytes:
            best, lo = SlotOption(slots, kv.n_ctx_seq, kv), mid + 1
        else:
            hi = mid - 1
    return best


def max_slots_for_ctx(
    shape: ModelShape, budget_bytes: int, ctx: int, *, unified: bool, type_k: str = "f16",
    type_v: str = "f16", most: int = 256,
) -> SlotOption | None:
    """The most slots of ``ctx`` tokens each that fit the budget (``None`` if not one)."""
    best = None
    for slots in range(1, most + 1):
        kv = kv_size(shape, ctx * slots, slots, unified=unified, type_k=type_k, type_v=type_v)
        if kv.total_bytes > budget_bytes:
            break
        best = SlotOption(slots, kv.n_ctx_seq, kv)
    return best


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """Parse a size like ``6GiB``, ``512 MiB``, ``8GB`` or ``1000000`` into bytes.

    :raises ValueError: not a number followed by a known unit.
    """
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    if unit not in _UNITS or not number:
        raise ValueError(f"not a size: {text!r} (use e.g. 6GiB, 512MiB, 8GB)")
    return int(float(number) * _UNITS[unit])
