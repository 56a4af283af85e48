"""Which backend slot a lease holds, and which slot caches the prompt a request continues.

Pure and synchronous. :class:`SlotMap` is the gateway's map of a llama-server's slots: which
are free, in least-recently-used order, and which leases hold which (so that the gateway
can send ``id_slot`` and later watch that very slot). :class:`PromptIndex` is the slot
affinity index: the prompt each slot last held, looked up by the prompt a new request
starts with.
"""

from __future__ import annotations

from collections import deque

from gateway.core.prefix import Prefix

__all__ = ["PromptIndex", "SlotMap"]


class SlotMap:
    """Free and held slot ids of one backend, least recently used first.

    A slot is free (in the LRU order), held (by a pinned lease), or, after a layout
    shrank, held past the end (it is given back but not made free again). Unpinned leases
    hold no slot; while any is in flight no lease is pinned (see :meth:`pick`).

    :param count: the backend's slots (0 while its layout is unknown).
    """

    def __init__(self, count: int = 0) -> None:
        self._count = count
        self._free: deque[int] = deque(range(count))  # never-used ones in index order
        self._held: set[int] = set()
        self._released_at: dict[int, int] = {}  # slot -> release count when last freed
        self._release_count = 0
        self._unpinned = 0  # unpinned leases in flight: their slots are llama-server's pick

    @property
    def count(self) -> int:
        """Slots in the current layout."""
        return self._count

    @property
    def free(self) -> tuple[int, ...]:
        """Free slot ids, least recently used first."""
        return tuple(self._free)

    @property
    def held(self) -> frozenset[int]:
        """Slot ids held by pinned leases in flight."""
        return frozenset(self._held)

    @property
    def unpinned(self) -> int:
        """Unpinned leases in flight."""
        return self._unpinned

    def resize(self, count: int) -> None:
        """Take a new layout of ``count`` slots: free slots past it are dropped, new ones
        are free (after the ones free already, in index order); held ones stay held."""
        self._count = count
        kept = [i for i in self._free if i < count]
        self._free = deque(kept + [i for i in range(count)
                                   if i not in self._held and i not in kept])

    def pick(self, pinnable: bool, slots: int, prefer: int | None = None) -> tuple[int, ...]:
        """Slot ids for a new lease, chosen as llama-server will place its tasks, or none
        (an unpinned lease, counted until :meth:`release`).

        The first (the ``id_slot`` sent) is ``prefer`` when it is free, else the least
        recently used free slot; the others, for ``slots > 1``, are the lowest-numbered
        free ones, which is where llama-server puts a request's extra completions
        (``get_free_slots`` in ``server-context.cpp``). A batch of prompts (not
        ``pinnable``) is not pinned, and while any unpinned lease is in flight no lease
        is: llama-server places those tasks itself, so the map of which slot is free
        would be wrong. Nor is a lease pinned when no slot is free.
        """
        return self.take(self.choose(pinnable, slots, prefer))

    def choose(self, pinnable: bool, slots: int, prefer: int | None = None
               ) -> tuple[int, ...]:
        """What :meth:`pick` would hand out now, taking nothing (give the result to
        :meth:`take`)."""
        if not pinnable or self._unpinned or not self._free:
            return ()
        first = prefer if prefer is not None and prefer in self._free else self._free[0]
        if slots <= 1:
            return (first,)
        return (first, *sorted(i for i in self._free if i != first)[:slots - 1])

    def take(self, slot_ids: tuple[int, ...]) -> tuple[int, ...]:
        """Hold ``slot_ids``, chosen elsewhere (by the shared state's script, which sees
        every process's leases); ``()`` counts an unpinned lease. Returns them, as
        :meth:`pick` does."""
        if not slot_ids:
            self._unpinned += 1
            return ()
        for slot in slot_ids:
            if slot in self._free:
                self._free.remove(slot)
        self._held.update(slot_ids)
        return slot_ids

    def release(self, slot_ids: tuple[int, ...]) -> None:
        """Give back what :meth:`pick` returned (``()``: an unpinned lease). The slots
        become the most recently used free ones (those past the current layout are
        dropped)."""
        if not slot_ids:
            self._unpinned -= 1
        for slot in slot_ids:
            self._held.discard(slot)
            self._release_count += 1
            self._released_at[slot] = self._release_count
            if slot < self._count:
                self._free.append(slot)  # held slots are never in _free

    def is_free(self, slot: int) -> bool:
        """No lease holds ``slot`` and it exists in the current layout."""
        return slot not in self._held and slot < self._count

    def last_released(self, slot: int) -> int:
        """When ``slot`` was last given back, as a count of releases (-1: never held);
        the lower, the less recently used."""
        return self._released_at.get(slot, -1)


class PromptIndex:
    """The prompt each slot last held (:class:`~gateway.core.prefix.Prefix`), indexed by
    the prompt's parts, for slot affinity."""

    def __init__(self) -> None:
        self._by_slot: dict[int, Prefix] = {}
        self._by_prompt: dict[tuple[str, ...], set[int]] = {}

    def remember(self, slot: int, prefix: Prefix | None) -> None:
        """Note that ``slot`` will have cached ``prefix`` (``None``: unknown, so nothing
        continues there)."""
        old = self._by_slot.pop(slot, None)
        if old is not None:
            holders = self._by_prompt.get(old.parts)
            if holders is not None:
                holders.discard(slot)
                if not holders:
                    del self._by_prompt[old.parts]
        if prefix is not None:
            self._by_slot[slot] = prefix
            self._by_prompt.setdefault(prefix.parts, set()).add(slot)

    def slot_for(self, prefix: Prefix | None, slots: SlotMap) -> int | None:
        """The free slot of ``slots`` whose last prompt this request continues (``prefix``
        extends it), the longest such if several (the least recently used of equals), or
        ``None``. llama-server keeps each slot's last prompt (``cache_prompt``), so a
        later turn pinned there (``id_slot``) computes only what is new; a slot another
        conversation has used since is not chosen. Looked up by each shorter prefix of
        the request (one dict lookup per message), not by scanning the slots."""
        if prefix is None:
            return None
        # A slot holding exactly this prompt is not extended by it (Prefix.extends): only
        # the shorter prefixes are looked up, and any slot found under one is extended.
        for n in range(len(prefix.parts) - 1, 0, -1):
            held = self._by_prompt.get(prefix.parts[:n])
            if not held:
                continue
            free = [s for s in held if slots.is_free(s)]
            if free:
                return min(free, key=slots.last_released)
        return None
