"""The orchestrator's control plane ahead of the work it schedules, on the cores they share.

On a host whose cores also run the sandboxes' commands (the embedded default, a small node), the
loop and ZeroMQ's I/O threads wait behind those commands for a core at every wake-up, so a no-op's
p99 round trip grows with the host's load. A lower niceness for those threads alone (the commands,
the tools' threads and everything forked keep the process's own) lets them preempt the work they
dispatch, as a node agent runs ahead of its pods.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

#: Threads of libzmq that carry the orchestrator's messages (``ZMQbg/IO/0``, ...).
_ZMQ_IO_PREFIX = "ZMQbg/IO"


def raise_control_plane(nice: int) -> list[int]:
    """Give the calling thread (the loop) and ZeroMQ's I/O threads the niceness ``nice``.

    Children forked later (by any thread) go back to the process's own niceness at once. Returns the
    threads changed: none where the host does not allow it (below 0 needs root or
    ``CAP_SYS_NICE``), which is logged and harmless.
    """
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if nice == base:
        return []
    me = threading.get_native_id()
    tids = [me]
    for name in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{name}/comm") as f:
                if f.read().startswith(_ZMQ_IO_PREFIX):
                    tids.append(int(name))
        except OSError:
            continue  # a thread that ended meanwhile
    changed = []
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except PermissionError:
            log.info(
                "the orchestrator's loop keeps niceness %d (lowering it to %d needs root or CAP_SYS_NICE; "
                "set loop_nice=%d to silence this)",
                base,
                nice,
                base,
            )
            break
        except ProcessLookupError:
            continue
        changed.append(tid)
    if changed:
        # A fork inherits its thread's niceness: what a tool forks runs as the process's own work.
        os.register_at_fork(after_in_child=lambda: os.setpriority(os.PRIO_PROCESS, 0, base))
        log.debug("threads %s at niceness %d ahead of the commands (%d)", changed, nice, base)
    return changed
