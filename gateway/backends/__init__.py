"""Backend kinds, one module each, and the registry keyed by ``kind``.

A kind is a class satisfying the :class:`~gateway.backends.base.Dialect` protocol (named
apart from the enum :class:`gateway.config.BackendKind`, which names a kind in the
configuration). Adding one means adding its module here and to :data:`KINDS`; config
refuses any other ``kind``.
"""

from __future__ import annotations

from gateway.backends.base import SIDE_CONNECTIONS, Dialect, Discovered, SideCalls
from gateway.backends.llamacpp import LlamaCpp
from gateway.backends.ollama import Ollama
from gateway.backends.vllm import Vllm

__all__ = ["KINDS", "SIDE_CONNECTIONS", "Dialect", "Discovered", "SideCalls", "kind_class"]

KINDS: dict[str, type[Dialect]] = {
    LlamaCpp.kind: LlamaCpp, Ollama.kind: Ollama, Vllm.kind: Vllm,
}


def kind_class(kind: str) -> type[Dialect]:
    """The class of backend ``kind``.

    :raises ValueError: an unknown kind; the message names the valid ones.
    """
    try:
        return KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown backend kind {kind!r}; valid kinds: "
                         f"{', '.join(sorted(KINDS))}") from None
