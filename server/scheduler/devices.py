"""The GPUs of one worker as the policy models them: which models each device holds, what is lent of it.

The ledger counts a worker's GPUs as one number; a reward model, though, is loaded on *devices*, and a
start is warm only if every device it runs on already holds its model. The policy keeps this model
of each GPU worker and places by it, choosing devices the way a GPU worker does: devices already
holding the model first, then the lowest index; each device caches models while its memory allows,
the least recently used idle one evicted first.
"""

from __future__ import annotations

from collections import OrderedDict

_EPS = 1e-9


def split(need: float) -> tuple[float, int]:
    """How a grant of ``need`` GPUs lies on devices: the share of each device it takes, and how many."""
    if need >= 1 - _EPS:
        return 1.0, round(need)
    return need, 1


class Devices:
    """One worker's GPU devices: per device the models loaded (LRU, with their memory) and the free share."""

    __slots__ = ("busy", "free", "loaded", "mem_mb")

    def __init__(self, count: int, mem_mb: float) -> None:
        self.mem_mb = mem_mb  # per device
        self.free = [1.0] * count
        self.loaded: list[OrderedDict[str, float]] = [OrderedDict() for _ in range(count)]
        self.busy: list[dict[str, int]] = [{} for _ in range(count)]  # model -> grants running it

    def _choose(self, kind: str, need: float) -> list[int] | None:
        share, count = split(need)
        # Devices holding the model first, then the emptiest (loading there evicts least), then by index.
        order = sorted(
            range(len(self.free)),
            key=lambda i: (kind not in self.loaded[i], sum(self.loaded[i].values()), len(self.loaded[i]), i),
        )
        chosen = [i for i in order if self.free[i] >= share - _EPS][:count]
        return chosen if len(chosen) == count else None

    def warm(self, kind: str, need: float) -> bool:
        """Whether a grant of ``need`` GPUs for ``kind`` would find its model on every device it took."""
        chosen = self._choose(kind, need)
        return chosen is not None and all(kind in self.loaded[i] for i in chosen)

    def holds(self, kind: str) -> bool:
        """Whether any device has ``kind`` loaded."""
        return any(kind in loaded for loaded in self.loaded)

    def take(self, kind: str, need: float, mem_mb: float) -> tuple[tuple[int, ...], bool, list[str]]:
        """Lend ``need`` GPUs to ``kind``, loading ``mem_mb`` of model per device where it is missing.

        Returns the devices, whether any had to load the model, and the models evicted for good from
        this worker (no device holds them any more). With no devices free (the ledger's count and this
        model disagree) it lends none and reports a cold start.
        """
        chosen = self._choose(kind, need)
        if chosen is None:
            return (), True, []
        share, _ = split(need)
        cold, evicted = False, []
        for i in chosen:
            self.free[i] -= share
            self.busy[i][kind] = self.busy[i].get(kind, 0) + 1
            loaded = self.loaded[i]
            if kind in loaded:
                loaded.move_to_end(kind)
                continue
            cold = True
            for old in list(loaded):
                if sum(loaded.values()) + mem_mb <= self.mem_mb + _EPS:
                    break
                if not self.busy[i].get(old):
                    del loaded[old]
                    evicted.append(old)
            loaded[kind] = mem_mb
        return tuple(chosen), cold, [k for k in dict.fromkeys(evicted) if not self.holds(k)]

    def give(self, kind: str, devices: tuple[int, ...], need: float) -> None:
        """A grant taken with :meth:`take` ended: its share of each device is free again."""
        share, _ = split(need)
        for i in devices:
            self.free[i] = min(1.0, self.free[i] + share)
            left = self.busy[i].get(kind, 0) - 1
            if left > 0:
                self.busy[i][kind] = left
            else:
                self.busy[i].pop(kind, None)

    def announce(self, kind: str, mem_mb: float) -> None:
        """The worker says it holds ``kind`` loaded (it joined with it): put it on the emptiest device."""
        if not self.loaded or self.holds(kind):
            return
        i = min(range(len(self.loaded)), key=lambda d: sum(self.loaded[d].values()))
        self.loaded[i][kind] = mem_mb
