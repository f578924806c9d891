"""The course's time questions ("which is faster, and by how much?"), notebooks 01, 03, 04, 07, 08:
how each is read from its measuring cell (``Measured``, the difference split into parts) and its
reference (the alpha-beta formulas, a fitted line, the ideal steps or the cost model). The questions
themselves are listed in ``course.py``."""
from __future__ import annotations

import statistics

from ddpkit.network import Link
from ddpkit.predictions import formulas
from ddpkit.predictions.question import faster_by
from ddpkit.predictions.reading import Measured, Term, parts_terms, remainder
from ddpkit.trace.gap import PART_LABELS

MiB = 2**20
KiB = 2**10


def faster_reference(setting, *_, predicted=None, **__):
    """A `faster` question's reference from the cost model's ms per step of each option (None
    without them): ``predicted={option: ms}``."""
    if not predicted:
        return None
    first, second = setting["options"]
    return faster_by(predicted[first], predicted[second])


def ref_04_overlap(setting, gain=None, parts=None, ideal=None, *_, predicted=None, **__):
    """Notebook 04's reference: the ideal steps it printed from its measured forward, backward and
    optimizer step on the matched link (``ideal={option: ms}``), else the cost model's."""
    return faster_reference(setting, predicted=ideal or predicted)


def faster_measured(first: str, second: str, times: dict, terms: list[Term], world_size: int, network: str,
            note: str, rest: str = "the rest (noise between runs, what the accounting leaves out)") -> Measured:
    t1, t2 = times[first], times[second]
    terms = remainder(t2 - t1, terms, rest, 1e-6)
    return Measured(faster_by(t1, t2), terms, "ms", times={first: t1, second: t2}, world_size=world_size,
                    network=network, note=note)


# --------------------------------------------------------------------------- 01 collectives
ONE, MANY = "one of 4 MiB", "64 of 64 KiB"


def ref_01(setting, sizes=None, measured=None, alpha=None, beta=None, *_, link: str = "loopback", **__):
    """The alpha-beta line notebook 01 fitted to this machine's all-reduces (``alpha``, ``beta``), or,
    before a fit, the ``link`` preset's."""
    n = setting["world_size"]
    if alpha is not None and beta is not None:
        link = Link("fitted", alpha, beta)
    return faster_by(formulas.all_reduce_ms(4 * MiB, n, link), 64 * formulas.all_reduce_ms(64 * KiB, n, link))


def read_01(setting, sizes, measured, alpha, beta):
    """``sizes`` (bytes) and ``measured`` (seconds) as notebook 01 times them; ``alpha``, ``beta``
    its fit (s, s/byte)."""
    n = setting["world_size"]
    t = dict(zip(sizes, measured, strict=True))
    if 4 * MiB not in t or 64 * KiB not in t:
        raise ValueError("notebook 01's sizes must include 64 KiB and 4 MiB")
    times = {ONE: 1e3 * t[4 * MiB], MANY: 64e3 * t[64 * KiB]}
    latency = 1e3 * 63 * 2 * (n - 1) * alpha
    bytes_term = 1e3 * (64 * 2 * (n - 1) / n * 64 * KiB - 2 * (n - 1) / n * 4 * MiB) * beta  # the same bytes: 0
    terms = [Term(f"63 more latencies, 63 x 2(N-1) alpha (alpha {alpha * 1e6:.0f} us fitted)", latency),
             Term("the bytes, 2(N-1)/N x 4 MiB x beta either way", bytes_term)]
    return faster_measured(ONE, MANY, times, terms, n, "loopback", "the median of each size's timings, 64 KiB times 64")


# --------------------------------------------------------------------------- 03 bucket caps
CAP1, CAP0 = "cap 1 MiB (8 buckets)", "cap 0 (66 buckets)"


def extra_latency_ms(setting) -> tuple[int, float]:
    """(how many more messages cap 0 sends than cap 1 MiB, the link's latency for them: each a ring
    all-reduce's 2(N-1) alpha), for the course's MLP on the setting's link."""
    n, link = setting["world_size"], formulas.LINKS[setting["network"]]
    module = formulas.meta_model()
    extra = len(formulas.bucket_elements(module, 0)) - len(formulas.bucket_elements(module, 1.0))
    return extra, 1e3 * extra * 2 * (n - 1) * link.alpha


def ref_03(setting, sweep=None, *_, strategy: str = "bucketed", **__):
    """The alpha-beta formula: cap 0 takes the cap-1 step (as measured in ``sweep``) plus the link's
    latency for its extra messages; the bytes are the same."""
    if sweep is None:
        return None
    base = statistics.median(sweep[(strategy, 1)])
    return faster_by(base, base + extra_latency_ms(setting)[1])


def read_03(setting, sweep, strategy: str = "bucketed"):
    """Notebook 03's sweep: ``{(strategy, cap): [ms per round]}``."""
    n = setting["world_size"]
    times = {CAP1: statistics.median(sweep[(strategy, 1)]), CAP0: statistics.median(sweep[(strategy, 0)])}
    extra, latency = extra_latency_ms(setting)
    terms = [Term(f"the link's latency for {extra} more messages, {extra} x 2(N-1) alpha", latency),
             Term("the bytes on the link: the same 8.04 MiB either way", 0.0)]
    times_terms = remainder(times[CAP0] - times[CAP1], terms,
                            f"each of the {extra} messages' own work beyond the link (launch, transport, wake-up)",
                            1e-6)
    return Measured(faster_by(times[CAP1], times[CAP0]), times_terms, "ms", times=times, world_size=n,
                    network=setting["network"], note=f"{strategy}: the median over the sweep's rounds")


# --------------------------------------------------------------------------- 04, 08 overlap
OVERLAPPED, BUCKETED = "overlapped", "bucketed"


def read_04_overlap(setting, gain, parts, ideal=None):
    """Notebook 04's timing rounds ``gain`` ({strategy: [ms]}) and the recorded runs' ``parts``
    ({strategy: step_breakdown(...).parts}); ``ideal`` ({strategy: ms}) is the reference's."""
    times = {s: statistics.median(gain[s]) for s in (OVERLAPPED, BUCKETED)}
    terms = parts_terms(parts[OVERLAPPED], parts[BUCKETED], PART_LABELS)
    return faster_measured(OVERLAPPED, BUCKETED, times, terms, setting["world_size"], setting["network"],
                   "ms per step: the timing rounds' medians; the parts: the recorded runs (step_breakdown)")


# --------------------------------------------------------------------------- 07 the cost model's check
FSDP = "fsdp"


def read_07(setting, checked):
    """``costmodel.validate`` records: measured ms per step of each, and the model's account of them."""
    by = {r["strategy"]: r for r in checked if "error" not in r}
    a, b = by[OVERLAPPED], by[FSDP]
    times = {OVERLAPPED: a["measured_ms"], FSDP: b["measured_ms"]}
    terms = [Term("compute in the model, each wrapper's own host work with it", b["compute_ms"] - a["compute_ms"]),
             Term("exposed communication in the model", b["exposed_comm_ms"] - a["exposed_comm_ms"])]
    return faster_measured(OVERLAPPED, FSDP, times, terms, setting["world_size"], setting["network"],
                   "measured: validate's timing rounds; the terms: the cost model's own step",
                   rest="what the model did not predict")


def ref_07(setting, checked=None, *_, predicted=None, **__):
    if checked is not None:
        predicted = {r["strategy"]: r["predicted_ms"] for r in checked if "error" not in r}
    return faster_reference(setting, predicted=predicted)


# --------------------------------------------------------------------------- 08 no_sync
EVERY8, EVERY1 = "sync every 8", "sync every 1"


def skipped_link_ms(setting) -> float:
    """The link's time for one step's all-reduces (1 MiB buckets of the course's MLP), 7 in 8 of
    which an iteration synchronising every 8th skips."""
    n, link = setting["world_size"], formulas.LINKS[setting["network"]]
    buckets = formulas.bucket_elements(formulas.meta_model(), 1.0)
    return sum(1e3 * formulas.collective_time("all_reduce", 4 * t, n, link) for t in buckets)


def read_08(setting, per_iteration):
    """Notebook 08's ``{every: [ms per iteration, per round]}``."""
    times = {EVERY8: statistics.median(per_iteration[8]), EVERY1: statistics.median(per_iteration[1])}
    sync_ms = skipped_link_ms(setting)
    terms = [Term(f"7 in 8 iterations' all-reduces skipped: 7/8 x {sync_ms:.1f} ms of link time", 7 / 8 * sync_ms)]
    return faster_measured(EVERY8, EVERY1, times, terms, setting["world_size"], setting["network"],
                   "ms per iteration: the median over the rounds (the slowest rank's)",
                   rest="the rest: 7 in 8 optimizer steps skipped, less the link time backward hid")


def ref_08(setting, per_iteration=None, *_, **__):
    """The alpha-beta formula: an iteration synchronising every 8th (as measured) plus 7/8 of one
    step's link time is what synchronising every iteration costs."""
    if per_iteration is None:
        return None
    base = statistics.median(per_iteration[8])
    return faster_by(base, base + 7 / 8 * skipped_link_ms(setting))
