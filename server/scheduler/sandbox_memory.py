"""What a live sandbox holds of its host's memory: one model for the server's ledger and the simulator.

A sandbox keeps its files and whatever its commands left running from its session's first action to
its close, idle or not: its *idle* footprint, which the ledger lends it for that whole time
(``ActionArrived.sandbox_mem_mb``). A command running in it may use more, up to the sandbox's memory
limit; that is the command's own demand, held only while it runs. The server takes a command's demand
from its tool's declaration; the simulator, which has no tools, from :meth:`SandboxMemory.command_mb`.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The share of a sandbox's memory limit it is taken to hold idle, unless configured (``reserve_mb``):
#: its workspace files and idle processes are usually far below what its heaviest command may use.
RESERVE_SHARE = 1 / 8


@dataclass(frozen=True)
class SandboxMemory:
    """A sandbox's memory: ``limit_mb`` for everything in it at once, ``reserve_mb`` of it held idle.

    ``reserve_mb`` None: :data:`RESERVE_SHARE` of the limit (the server's default).
    """

    limit_mb: float
    reserve_mb: float | None = None

    @property
    def idle_mb(self) -> float:
        """What the sandbox holds from its session's first action to its close, between commands too."""
        return self.limit_mb * RESERVE_SHARE if self.reserve_mb is None else self.reserve_mb

    def command_mb(self, max_par: int = 1) -> float:
        """Per unit, what a command may use above the idle footprint while it runs.

        The rest of the limit, so that the sandbox at its peak holds its whole limit; an elastic
        command's ``max_par`` units (test shards, say) share it, the limit being sized for its widest run.
        """
        return max(0.0, self.limit_mb - self.idle_mb) / max(1, max_par)
