"""The course's "which is faster, and how many times?" questions (notebooks 01, 03, 04, 07, 08), each
declared once: its words, its reader (-> ``Measured``) and its reference (alpha-beta, the model).
"""
from __future__ import annotations

import statistics

from ddpkit.network import LINKS, Link, collective_time
from ddpkit.predictions import formulas
from ddpkit.predictions.question import Question, Setting, from_the_run, speedup, speedup_spread
from ddpkit.predictions.reading import Measured, Term, parts_terms, remainder
from ddpkit.trace.gap import PART_LABELS
from ddpkit.units import human_bytes

MiB, KiB = 2**20, 2**10
BUCKETED = formulas.ours("DDP", overlap=False)
OVERLAPPED = formulas.ours("DDP", overlap=True)
FSDP = formulas.ours("ZeRO-3")


def measured_faster(q_options, rounds: dict[str, list[float]], terms: list[Term], setting: Setting, note: str,
                    *, reference: float | None = None, middle_half: bool = False,
                    rest: str = "the rest (noise between runs, what the accounting leaves out)") -> Measured:
    """Two options' rounds (ms) as a ``Measured``: the medians' speed-up, the rounds' spread (each
    option's fastest against the other's slowest; ``middle_half``: their quartiles, for many calls),
    and ``terms``, the parts of the difference between the medians (the rest one more term)."""
    first, second = q_options
    times = {o: statistics.median(rounds[o]) for o in q_options}
    if middle_half:
        spread = speedup_spread(*(_quartiles(rounds[o]) for o in q_options))
    else:
        spread = speedup_spread(rounds[first], rounds[second])
    return Measured(speedup(times[first], times[second]), remainder(times[second] - times[first], terms, rest, 1e-6),
                    "ms", times=times, spread=spread, reference=reference, world_size=setting.world_size,
                    network=setting.network, note=note)


def _quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[2]


# --------------------------------------------------------------------------- 01 one message or many
BIG, SMALL = 4 * MiB, 64 * KiB
ONE, MANY = f"one of {human_bytes(BIG, 0)}", f"{BIG // SMALL} of {human_bytes(SMALL, 0)}"


def speedup_on(link: Link, n: int) -> float:
    """One all-reduce of BIG against BIG // SMALL of SMALL, one after the other, on ``link``."""
    return speedup(collective_time("all_reduce", BIG, n, link),
                   BIG // SMALL * collective_time("all_reduce", SMALL, n, link))


def read_call_timings(setting: Setting, sizes: list[int], calls: list[list[float]], alpha: float,
                      beta: float) -> Measured:
    """Notebook 01's ``sizes`` (bytes), ``calls`` (seconds of every call, [size][call]) and the
    ``alpha`` (s), ``beta`` (s/byte) fitted to their medians."""
    n, k = setting.world_size, BIG // SMALL
    by_size = dict(zip(sizes, calls, strict=True))
    if BIG not in by_size or SMALL not in by_size:
        raise ValueError(f"notebook 01's sizes must include {human_bytes(SMALL, 0)} and {human_bytes(BIG, 0)}")
    rounds = {ONE: [1e3 * t for t in by_size[BIG]], MANY: [k * 1e3 * t for t in by_size[SMALL]]}
    fitted = Link("fitted", alpha, beta)
    latency = 1e3 * (k - 1) * collective_time("all_reduce", 0, n, fitted)
    apart = k * collective_time("all_reduce", SMALL, n, fitted) - collective_time("all_reduce", BIG, n, fitted)
    terms = [Term(f"{k - 1} more all-reduces' latency, {k - 1} x 2(N-1) alpha (alpha {alpha * 1e6:.0f} us fitted)",
                  latency),
             Term(f"the bytes: the same {human_bytes(BIG, 0)} either way, 2(N-1)/N x S x beta", 1e3 * apart - latency)]
    return measured_faster((ONE, MANY), rounds, terms, setting, f"the median of each size's calls, "
                           f"{human_bytes(SMALL, 0)} times {k}; the spread: the middle half of the calls",
                           reference=speedup_on(fitted, n), middle_half=True)


ONE_VS_MANY = Question(
    key="01.one_vs_many", unit="x", quantity="time", options=(ONE, MANY), setting=Setting(world_size=2),
    text=f"One all-reduce of {human_bytes(BIG, 0)}, or {BIG // SMALL} all-reduces of {human_bytes(SMALL, 0)} "
         "(the same bytes), on these {world_size} ranks: which takes less time, and how many times less?",
    hint="Each message pays the latency alpha; every byte pays beta.",
    read=read_call_timings, reference=lambda s: speedup_on(LINKS["loopback"], s.world_size),
    reference_from="the alpha-beta line fitted to this machine above (before a fit, the loopback preset's)")


# --------------------------------------------------------------------------- 03 bucket caps
CAP1, CAP0 = "cap 1 MiB", "cap 0"


def extra_latency(setting: Setting) -> tuple[int, float]:
    """How many more all-reduces cap 0 launches than cap 1 MiB, and the link's latency for them, ms."""
    module = formulas.meta_model()
    extra = len(formulas.bucket_elements(module, 0)) - len(formulas.bucket_elements(module, 1.0))
    return extra, 1e3 * extra * collective_time("all_reduce", 0, setting.world_size, LINKS[setting.network])


def read_cap_sweep(setting: Setting, sweep: dict[tuple[str, float], list[float]]) -> Measured:
    """Notebook 03's sweep, ``{(strategy, cap MiB): [ms per round]}``, BucketedDDP's caps 1 and 0.
    Reference: the cap-1 step as measured, plus the link's latency for cap 0's extra messages."""
    rounds = {CAP1: sweep[(BUCKETED, 1)], CAP0: sweep[(BUCKETED, 0)]}
    extra, latency = extra_latency(setting)
    base = statistics.median(rounds[CAP1])
    terms = [Term(f"the link's latency for {extra} more messages, {extra} x 2(N-1) alpha", latency),
             Term(f"the bytes on the link: the same {formulas.mlp_facts()['gradients']} either way", 0.0)]
    return measured_faster((CAP1, CAP0), rounds, terms, setting, f"{BUCKETED}: the median over the sweep's rounds",
                           reference=speedup(base, base + latency),
                           rest=f"each of the {extra} messages' own work beyond the link (launch, transport, wake-up)")


CAPS = Question(
    key="03.cap1_vs_cap0", unit="x", quantity="time", options=(CAP1, CAP0),
    setting=Setting(world_size=2, network="paper"), facts=lambda s: formulas.mlp_facts(),
    text="On the \"{network}\" network, BucketedDDP with a 1 MiB cap ({buckets} all-reduces a step) or a cap of 0 "
         "({tensors}, one per gradient): which step is faster, and how many times?",
    hint="Notebook 01 split a collective's time in two terms: which of them do the two caps pay alike?",
    read=read_cap_sweep, reference=from_the_run,
    reference_from="the alpha-beta formula on the link, from the cap-1 time")


# --------------------------------------------------------------------------- 04 overlap
def read_rounds_and_parts(setting: Setting, rounds: dict[str, list[float]], parts: dict[str, dict[str, float]],
                          ideal: dict[str, float] | None = None) -> Measured:
    """Notebook 04's timing ``rounds`` ({strategy: [ms per step]}), its median rounds' ``parts``
    ({strategy: step_breakdown(...).parts}) and the ``ideal`` steps it printed ({strategy: ms})."""
    terms = parts_terms(parts[OVERLAPPED], parts[BUCKETED], PART_LABELS)
    return measured_faster((OVERLAPPED, BUCKETED), rounds, terms, setting,
                           "ms per step: the timing rounds' medians; the parts: the recorded runs (step_breakdown)",
                           reference=None if ideal is None else speedup(ideal[OVERLAPPED], ideal[BUCKETED]))


OVERLAP = Question(
    key="04.overlapped_vs_bucketed", unit="x", quantity="time", options=(OVERLAPPED, BUCKETED),
    setting=Setting(world_size=2, network="matched"),
    text="On the \"{network}\" link with 0.5 MiB buckets: OverlappedDDP or BucketedDDP, which step is faster, "
         "and how many times?",
    hint="What can hide under backward, and what does the hook add to backward on these cores?",
    read=read_rounds_and_parts, reference=from_the_run,
    reference_from="the ideal steps printed from the measured forward, backward and step: overlap's best, "
                   "with no hook work and no bytes to move at the wait")


# --------------------------------------------------------------------------- 07 the cost model's check
def read_validation(setting: Setting, checked: list[dict]) -> Measured:
    """``costmodel.validate``'s records: each strategy's measured ms per step (its rounds), the
    model's account of them, and its prediction (the reference)."""
    by = {r["strategy"]: r for r in checked if "error" not in r}
    a, b = by[OVERLAPPED], by[FSDP]
    rounds = {s: by[s].get("measured_ms_rounds") or [by[s]["measured_ms"]] for s in (OVERLAPPED, FSDP)}
    terms = [Term("compute in the model, each wrapper's own host work with it", b["compute_ms"] - a["compute_ms"]),
             Term("exposed communication in the model", b["exposed_comm_ms"] - a["exposed_comm_ms"])]
    return measured_faster((OVERLAPPED, FSDP), rounds, terms, setting,
                           "measured: validate's timing rounds; the terms: the cost model's own step",
                           reference=speedup(a["predicted_ms"], b["predicted_ms"]),
                           rest="what the model did not predict")


OVERLAPPED_VS_FSDP = Question(
    key="07.overlapped_vs_fsdp", unit="x", quantity="time", options=(OVERLAPPED, FSDP),
    setting=Setting(world_size=4, network="1GbE"),
    text="{world_size} ranks on the emulated \"{network}\": OverlappedDDP or FSDP, which step is faster, "
         "and how many times?",
    hint="FSDP sends 1.5x DDP's bytes, in three collectives per unit.",
    read=read_validation, reference=from_the_run, reference_from="the cost model")


# --------------------------------------------------------------------------- 08 no_sync
EVERY8, EVERY1 = "sync every 8", "sync every 1"


def skipped_link_ms(setting: Setting) -> float:
    """The link's time for one step's all-reduces (1 MiB buckets), 7 in 8 of which every-8 skips."""
    buckets = formulas.bucket_elements(formulas.meta_model(), 1.0)
    return sum(1e3 * collective_time("all_reduce", 4 * t, setting.world_size, LINKS[setting.network]) for t in buckets)


def read_iteration_times(setting: Setting, per_iteration: dict[int, list[float]]) -> Measured:
    """Notebook 08's ``{every: [ms per iteration, per round]}``. Reference: an iteration
    synchronising every 8th (as measured) plus 7/8 of one step's link time."""
    rounds = {EVERY8: per_iteration[8], EVERY1: per_iteration[1]}
    sync_ms = skipped_link_ms(setting)
    base = statistics.median(rounds[EVERY8])
    terms = [Term(f"7 in 8 iterations' all-reduces skipped: 7/8 x {sync_ms:.1f} ms of link time", 7 / 8 * sync_ms)]
    return measured_faster((EVERY8, EVERY1), rounds, terms, setting,
                           "ms per iteration: the median over the rounds (the slowest rank's)",
                           reference=speedup(base, base + 7 / 8 * sync_ms),
                           rest="the rest: 7 in 8 optimizer steps skipped, less the link time backward hid")


NO_SYNC = Question(
    key="08.every8_vs_every1", unit="x", quantity="time", options=(EVERY8, EVERY1),
    setting=Setting(world_size=2, network="paper"),
    text="On the \"{network}\" network: synchronising every 8th iteration (no_sync for the 7 before it) or every "
         "iteration, which is faster per iteration, and how many times?",
    read=read_iteration_times, reference=from_the_run,
    reference_from="the alpha-beta formula on the link, from the every-8 time")

QUESTIONS = [ONE_VS_MANY, CAPS, OVERLAP, OVERLAPPED_VS_FSDP, NO_SYNC]
