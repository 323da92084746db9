"""Action states, the one table of legal transitions, and a bounded log of what happened to each action."""

from __future__ import annotations

import enum
from collections import OrderedDict
from typing import Any

#: A story detail: text, or a tuple of parts joined with spaces when the story is read (cheap to log).
Detail = str | tuple[Any, ...]


class ActionState(str, enum.Enum):
    """Where an action is in a scheduler's books."""

    NEW = "new"  # not known yet (the origin of the first transition)
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    REJECTED = "rejected"


S = ActionState
#: Every legal transition, listed once. ``RUNNING -> PENDING`` is a requeue after its worker left.
TRANSITIONS: frozenset[tuple[ActionState, ActionState]] = frozenset(
    {
        (S.NEW, S.PENDING),
        (S.PENDING, S.RUNNING),
        (S.PENDING, S.CANCELLED),
        (S.PENDING, S.REJECTED),
        (S.RUNNING, S.DONE),
        (S.RUNNING, S.PENDING),
    }
)

_NEXT: dict[str, tuple[ActionState, ...]] = {
    old.value: tuple(new for o, new in TRANSITIONS if o is old) for old in ActionState
}


class IllegalTransition(AssertionError):
    """A scheduler tried to move an action along a transition that is not in :data:`TRANSITIONS`."""


class StoryLog:
    """The last ``per_action`` transitions of the last ``actions`` actions seen (older ones are dropped)."""

    def __init__(self, per_action: int = 32, actions: int = 10_000) -> None:
        self.per_action = per_action
        self.actions = actions
        self._log: OrderedDict[str, list[tuple[float, ActionState, ActionState, Detail]]] = OrderedDict()

    def record(
        self, action_id: str, now: float, old: ActionState, new: ActionState, detail: Detail = ""
    ) -> None:
        """Log one transition; raises :class:`IllegalTransition` for one not in the table."""
        if new not in _NEXT[old._value_]:  # the table, keyed for speed: this runs on every transition
            raise IllegalTransition(
                f"action {action_id}: {old.value} -> {new.value} is not a legal transition"
            )
        log = self._log.get(action_id)
        if log is None:
            self._log[action_id] = [(now, old, new, detail)]
            if len(self._log) > self.actions:
                self._log.popitem(last=False)
            return
        log.append((now, old, new, detail))
        if len(log) > self.per_action:
            del log[0]

    def note(self, action_id: str, now: float, state: ActionState, detail: Detail) -> None:
        """Log something that happened to ``action_id`` without a change of state."""
        log = self._log.get(action_id)
        if log is not None:
            log.append((now, state, state, detail))
            if len(log) > self.per_action:
                del log[0]

    def story(self, action_id: str) -> list[tuple[float, str, str, str]]:
        """Return the logged transitions of ``action_id``, oldest first (empty when unknown or forgotten)."""
        return [(t, a.value, b.value, _text(d)) for t, a, b, d in self._log.get(action_id, ())]


def _text(detail: Detail) -> str:
    if isinstance(detail, str):
        return detail
    return " ".join(f"{x:.3g}" if isinstance(x, float) else str(x) for x in detail)
