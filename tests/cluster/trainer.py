"""A trainer process for cluster tests: keeps a window of actions in flight, records every result.

    python -m tests.cluster.trainer --address tcp://... --tag t0 --n 300 --window 16 --dir MARKS --out t0.json

It submits ``cluster.mark`` actions with ids ``<tag>-<i>`` (at most ``--window`` unanswered at a time,
as a batch of environments stepping would) and writes one JSON record per result to ``--out``. With
``--gate PATH --gate-at K`` it submits nothing from action ``K`` on until ``PATH`` exists (results keep
arriving meanwhile), so a test can change the cluster between two phases of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

from tangram_env import Action, Client
from tangram_env.protocol import Result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--seconds", type=float, default=0.1)
    p.add_argument("--dir", required=True, help="where the tool leaves its marks")
    p.add_argument("--out", required=True)
    p.add_argument("--deadline", type=float, default=120.0, help="give up after this many seconds")
    p.add_argument("--gate", help="a file that must exist before action --gate-at is submitted")
    p.add_argument("--gate-at", type=int, default=0)
    args = p.parse_args(argv)

    def at_gate(i: int) -> bool:
        return args.gate is not None and i >= args.gate_at and not os.path.exists(args.gate)

    records: list[dict[str, object]] = []
    in_flight: dict[Future[Result], str] = {}
    t_end = time.monotonic() + args.deadline
    with Client(args.address) as client:
        nxt = 0
        while (nxt < args.n or in_flight) and time.monotonic() < t_end:
            batch: list[Action] = []
            while nxt < args.n and len(in_flight) + len(batch) < args.window and not at_gate(nxt):
                batch.append(
                    Action(
                        id=f"{args.tag}-{nxt}",
                        kind="cluster.mark",
                        trajectory_id=f"{args.tag}-{nxt % 8}",
                        payload={"dir": args.dir, "seconds": args.seconds},
                    )
                )
                nxt += 1
            for action, fut in zip(batch, client.submit(batch), strict=True):
                in_flight[fut] = action.id
            gated = at_gate(nxt)
            if not in_flight:  # at the gate with nothing outstanding
                time.sleep(0.05)
                continue
            wait_s = 0.05 if gated else max(0.0, t_end - time.monotonic())
            done, _ = wait(list(in_flight), timeout=wait_s, return_when=FIRST_COMPLETED)
            for fut in done:
                action_id = in_flight.pop(fut)
                try:
                    r = fut.result()
                except Exception as exc:  # a client-side failure is a result the test must see
                    records.append(
                        {"id": action_id, "ok": False, "error_type": "client", "message": repr(exc)}
                    )
                    continue
                records.append(
                    {
                        "id": r.action_id,
                        "ok": r.ok,
                        "worker": r.worker,
                        "error_type": r.error_type,
                        "message": r.message,
                        "act_s": r.timing.act_s,
                        "value": r.value,
                    }
                )
        unanswered = sorted(in_flight.values())
    with open(args.out, "w") as f:
        json.dump({"records": records, "unanswered": unanswered, "submitted": nxt}, f)
    return 0 if not unanswered and nxt == args.n else 1


if __name__ == "__main__":
    sys.exit(main())
