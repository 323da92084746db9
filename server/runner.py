"""The interface between a worker's socket loop and what actually runs actions on its host.

A runner is driven from one thread: ``start`` never blocks, and finished results are picked up with
``collect`` whenever one of ``wait_fds`` turns readable (or on the loop's own timer). The local process
executor (CPU) and the reward-model host (GPU) are runners; so is anything a worker host adds.
"""

from __future__ import annotations

from typing import Protocol

from tangram_env.protocol import Grant, Resources, Result


class Runner(Protocol):
    """Runs granted actions on this host and reports their results."""

    name: str

    def capacity(self) -> Resources:
        """What this runner can lend at once (announced to the scheduler)."""
        ...

    def kinds(self) -> frozenset[str] | None:
        """The action kinds it serves (None: every kind registered here)."""
        ...

    def start(self, grant: Grant) -> None:
        """Begin running ``grant``'s action; must return at once."""
        ...

    def wait_fds(self) -> list[int]:
        """File descriptors that become readable when a result may be ready."""
        ...

    def collect(self) -> list[Result]:
        """Results of actions that finished since the last call (never blocks)."""
        ...

    def cancel(self, action_ids: list[str]) -> None:
        """Stop these actions if it runs them (their owner cancelled them): each ends with a
        ``cancelled`` result; one it does not run, or cannot stop (a batch on a device), ends as it would.
        """
        ...

    def end_sessions(self, sessions: list[str]) -> None:
        """These sandbox sessions are over: reset their sandboxes (off the loop)."""
        ...

    def maintain(self) -> None:
        """Upkeep its worker asks for about once a second (warm sandboxes idle too long closed);
        must return at once.
        """
        ...

    def stats(self) -> dict[str, object]:
        """Figures about the runner's state (loaded models, queue lengths, pool sizes)."""
        ...

    def unrecoverable(self) -> str | None:
        """Why it can run nothing more until its process starts afresh (a device stuck in a model's
        code); None while it can. Its worker then exits, for a supervisor to start it again.
        """
        ...

    def close(self) -> None:
        """Stop everything it runs and free its resources."""
        ...
