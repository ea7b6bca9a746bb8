"""The fast forward's KV caches: requests' caches side by side in one pool (``KVPool``), one
request's cache (``KVState``), a slot of the pool or buffers of its own."""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Callable

import torch

from llm_worker.model.target import SequenceState

GROW = 512  # KV capacity grows in steps of this many positions

BufferMaker = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
"""(slots, capacity) → zeroed keys [layers, slots, kv, capacity, d] and values [..., d + 1]."""


class KVPool:
    """The KV caches of up to ``max_slots`` requests side by side in one buffer (keys
    [layers, slots, kv, capacity, d], values [..., d + 1]), so that attention can run every
    pooled request's decode rows as one batched GEMM over a slice of slots (``TorchOps``'s
    grouped attention) instead of one small GEMM chain per request. Slots and capacity grow by
    reallocation (every slot shares the capacity of the longest request); a slot is freed when its
    state is collected. Callers hold the target's lock: growth must not race a forward's or a
    commit's writes."""

    def __init__(self, make: BufferMaker, max_slots: int) -> None:
        self.make = make
        self.max_slots = max_slots
        self.keys, self.values = make(0, GROW)
        self._free: list[int] = []  # slots below ``slots`` nobody holds, as a heap
        self._released: list[int] = []  # appended by finalizers (any thread), drained under the lock

    @property
    def slots(self) -> int:
        return int(self.keys.shape[1])

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[3])

    def acquire(self) -> int | None:
        """The lowest free slot (so the slots in use stay packed), or None when the pool is full."""
        while self._released:
            heapq.heappush(self._free, self._released.pop())
        if not self._free:
            if self.slots >= self.max_slots:
                return None
            self._resize(min(self.max_slots, max(1, 2 * self.slots)), self.capacity)
        return heapq.heappop(self._free)

    def usage(self) -> tuple[int, int]:
        """(slots held by requests now, most slots the pool may have). Example: a pool of 8 whose
        buffer has grown to 4 slots, 1 of them free → (3, 8)."""
        return self.slots - len(self._free) - len(self._released), self.max_slots

    def release(self, slot: int) -> None:
        self._released.append(slot)  # list.append is atomic: safe from a finalizer in any thread

    def reserve(self, capacity: int) -> None:
        if capacity > self.capacity:
            self._resize(self.slots, capacity)

    def _resize(self, slots: int, capacity: int) -> None:
        keys, values = self.make(slots, capacity)
        old_slots, old_capacity = self.slots, self.capacity
        keys[:, :old_slots, :, :old_capacity] = self.keys
        values[:, :old_slots, :, :old_capacity] = self.values
        self.keys, self.values = keys, values
        for slot in range(old_slots, slots):
            heapq.heappush(self._free, slot)


class KVState(SequenceState):
    """One request's cache: a slot of the pool, or its own buffers when the pool is full."""

    def __init__(
        self,
        pool: KVPool | None,
        slot: int,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
    ) -> None:
        self.length = 0
        self.pool = pool
        self.slot = slot
        self._keys = keys
        self._values = values
        if pool is not None:
            weakref.finalize(self, pool.release, slot)

    @property
    def keys(self) -> torch.Tensor:
        """[layers, 1, kv_heads, capacity, head_dim]"""
        if self.pool is not None:
            return self.pool.keys[:, self.slot : self.slot + 1]
        assert self._keys is not None
        return self._keys

    @property
    def values(self) -> torch.Tensor:
        """[layers, 1, kv_heads, capacity, head_dim + 1]: the last column is 1"""
        if self.pool is not None:
            return self.pool.values[:, self.slot : self.slot + 1]
        assert self._values is not None
        return self._values

    def set_buffers(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        assert self.pool is None
        self._keys, self._values = keys, values

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole buffers its cache lives in at ``layer`` (the pool's every slot, or its own):
        keys [slots, kv, capacity, d], values [..., d + 1]."""
        if self.pool is not None:
            return self.pool.keys[layer], self.pool.values[layer]
        return self.keys[layer], self.values[layer]
