"""Read a :class:`~gateway.planner.planning.ModelShape` from a GGUF file or an HF ``config.json``.

GGUF keys (llama.cpp ``src/llama-arch.cpp``; ``A`` = ``general.architecture``):
``A.block_count``, ``A.context_length``, ``A.embedding_length``,
``A.attention.head_count``, ``A.attention.head_count_kv`` (scalar or per layer; default
head_count), ``A.attention.key_length``/``value_length`` (default embedding/head_count),
``A.attention.sliding_window`` and ``A.attention.sliding_window_pattern``. Only metadata is
read (the ``gguf`` package maps the file; tensor data is never touched).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.planner.planning import ModelShape

__all__ = ["from_dims", "from_gguf", "from_hf_config"]

# Default sliding-window periods when the GGUF gives none: layer il is SWA iff
# il % period < period - 1 (llama.cpp set_swa_pattern; gemma3.cpp uses 6, gemma2 2).
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6, "cohere2": 4, "llama4": 4}
_MLA_ARCHS = {"deepseek2", "deepseek3", "glm-dsa"}


def _swa_layers(n_layer: int, period: int) -> frozenset[int]:
    return frozenset(il for il in range(n_layer) if il % period < period - 1)


def _per_layer(value: Any, n_layer: int) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),) * n_layer


def from_gguf(path: str | Path) -> ModelShape:
    """Shape of the model in a GGUF file (metadata only).

    :raises ValueError: the file lacks the keys needed (architecture, block count, heads),
        or the ``gguf`` package (the ``plan`` extra) is not installed.
    """
    try:
        from gguf import GGUFReader
    except ModuleNotFoundError:
        raise ValueError("reading a GGUF file needs the gguf package: pip install "
                         "'llm-admission-gateway[plan]' (or '.[plan]' from a checkout)"
                         ) from None

    reader = GGUFReader(str(path))

    def get(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = get("general.architecture")
    if not arch:
        raise ValueError(f"{path}: no general.architecture in the GGUF metadata")
    n_layer = get(f"{arch}.block_count")
    n_head = get(f"{arch}.attention.head_count")
    if n_layer is None or n_head is None:
        raise ValueError(f"{path}: missing {arch}.block_count or {arch}.attention.head_count")
    n_layer = int(n_layer)
    heads = _per_layer(n_head, n_layer)
    kv_heads = _per_layer(get(f"{arch}.attention.head_count_kv", n_head), n_layer)
    embd = int(get(f"{arch}.embedding_length", 0))
    default_head = embd // heads[0] if heads[0] else 0
    head_k = int(get(f"{arch}.attention.key_length", default_head))
    head_v = int(get(f"{arch}.attention.value_length", default_head))
    n_swa = int(get(f"{arch}.attention.sliding_window", 0) or 0)
    swa: frozenset[int] = frozenset()
    if n_swa:
        pattern = get(f"{arch}.attention.sliding_window_pattern")
        if isinstance(pattern, (list, tuple)):
            swa = frozenset(i for i, is_swa in enumerate(pattern) if is_swa)
        elif pattern:
            swa = _swa_layers(n_layer, int(pattern))
        elif arch in _SWA_PERIOD:
            swa = _swa_layers(n_layer, _SWA_PERIOD[arch])
    ctx = get(f"{arch}.context_length")
    return ModelShape(
        name=str(get("general.name", arch)), n_head_kv=kv_heads, head_k=head_k, head_v=head_v,
        swa_layers=swa, n_swa=n_swa, n_ctx_train=int(ctx) if ctx else None,
        weights_bytes=Path(path).stat().st_size, has_v=arch not in _MLA_ARCHS,
    )


def from_hf_config(path: str | Path) -> ModelShape:
    """Shape from a Hugging Face ``config.json`` (``num_hidden_layers``,
    ``num_key_value_heads``, ``head_dim``, ``sliding_window``, ``layer_types``).

    :raises ValueError: required keys are missing.
    """
    cfg = json.loads(Path(path).read_text())
    cfg = cfg.get("text_config", cfg)
    try:
        n_layer = int(cfg["num_hidden_layers"])
        n_head = int(cfg["num_attention_heads"])
    except KeyError as exc:
        raise ValueError(f"{path}: missing {exc.args[0]}") from None
    kv = int(cfg.get("num_key_value_heads") or n_head)
    head = int(cfg.get("head_dim") or cfg["hidden_size"] // n_head)
    n_swa = int(cfg.get("sliding_window") or 0)
    swa: frozenset[int] = frozenset()
    if n_swa and isinstance(cfg.get("layer_types"), list):
        swa = frozenset(i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention")
    elif n_swa and cfg.get("sliding_window_pattern"):
        swa = _swa_layers(n_layer, int(cfg["sliding_window_pattern"]))
    elif n_swa and cfg.get("model_type") in _SWA_PERIOD:
        swa = _swa_layers(n_layer, _SWA_PERIOD[cfg["model_type"]])
    return ModelShape(
        name=str(cfg.get("model_type", Path(path).parent.name)), n_head_kv=(kv,) * n_layer,
        head_k=head, head_v=head, swa_layers=swa, n_swa=n_swa,
        n_ctx_train=cfg.get("max_position_embeddings"),
    )


def from_dims(layers: int, kv_heads: int, head_dim: int) -> ModelShape:
    """Shape from explicit numbers: every layer full attention, ``kv_heads`` each."""
    return ModelShape(name="custom", n_head_kv=(kv_heads,) * layers, head_k=head_dim,
                      head_v=head_dim)
