"""The course's questions, one per measurement it asks the learner to predict (notebooks 01-12).

Each ``Question`` says what is asked, in which unit, its reference answer (``formulas``, or the
cost model's times) and how its measuring cell's results are read (a ``reading.Measured``):

    ddpkit.ask("02.naive_bytes")                 # before the measuring cell (ddpkit.predictions.asking)
    ...the measuring cell...
    q.reveal(trace)                              # after it: read, scored, taken apart, kept

``QUESTIONS`` is the one list of them, by key ("<notebook>.<name>"); ``tests/test_predictions.py``
checks every reference against a measurement of its own setting.
"""
from __future__ import annotations

import statistics

from ddpkit.network import Link, collective_time
from ddpkit.predictions import formulas
from ddpkit.predictions.question import Question, faster_by
from ddpkit.predictions.reading import Measured, Term, bytes_sent, memory_terms, parts_terms, remainder, ring_terms
from ddpkit.trace.gap import PART_LABELS

MiB = 2**20
KiB = 2**10


def _field(row, name: str):
    """A field of a run's result: ``run_strategy``'s ``RunResult``, or a ``compare`` record (a dict)."""
    return row[name] if isinstance(row, dict) else getattr(row, name)


def _predicted(setting, *_, predicted=None, **__):
    """A `faster` question's reference from the cost model's ms per step of each option (None
    without them): ``predicted={option: ms}``."""
    if not predicted:
        return None
    first, second = setting["options"]
    return faster_by(predicted[first], predicted[second])


def _ideal(setting, gain=None, parts=None, ideal=None, *_, predicted=None, **__):
    """Notebook 04's reference: the ideal steps it printed from its measured forward, backward and
    optimizer step on the matched link (``ideal={option: ms}``), else the cost model's."""
    return _predicted(setting, predicted=ideal or predicted)


def _faster(first: str, second: str, times: dict, terms: list[Term], world_size: int, network: str,
            note: str, rest: str = "the rest (noise between runs, what the accounting leaves out)") -> Measured:
    t1, t2 = times[first], times[second]
    terms = remainder(t2 - t1, terms, rest, 1e-6)
    return Measured(faster_by(t1, t2), terms, "ms", times={first: t1, second: t2}, world_size=world_size,
                    network=network, note=note)


# --------------------------------------------------------------------------- 01 collectives
ONE, MANY = "one of 4 MiB", "64 of 64 KiB"


def _ref_01(setting, sizes=None, measured=None, alpha=None, beta=None, *_, link: str = "loopback", **__):
    """The alpha-beta line notebook 01 fitted to this machine's all-reduces (``alpha``, ``beta``), or,
    before a fit, the ``link`` preset's."""
    n = setting["world_size"]
    if alpha is not None and beta is not None:
        fitted = Link("fitted", alpha, beta)
        one, each = (1e3 * collective_time("all_reduce", size, n, fitted) for size in (4 * MiB, 64 * KiB))
        return faster_by(one, 64 * each)
    return faster_by(formulas.all_reduce_ms(4 * MiB, n, link), 64 * formulas.all_reduce_ms(64 * KiB, n, link))


def _read_01(setting, sizes, measured, alpha, beta):
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
    return _faster(ONE, MANY, times, terms, n, "loopback", "the median of each size's timings, 64 KiB times 64")


# --------------------------------------------------------------------------- 02, 03, 05, 11: bytes in a trace
def _read_trace_bytes(setting, trace):
    return bytes_sent(trace, MiB)


def _ref_ddp_bytes(setting, *_, **__):
    return formulas.ddp_bytes(setting["world_size"]) / MiB


def _ref_fsdp_bytes(setting, *_, **__):
    return formulas.fsdp_bytes(setting["world_size"]) / MiB


# --------------------------------------------------------------------------- 03 bucket caps
CAP1, CAP0 = "cap 1 MiB (8 buckets)", "cap 0 (66 buckets)"


def _extra_latency_ms(setting) -> tuple[int, float]:
    """(how many more messages cap 0 sends than cap 1 MiB, the link's latency for them: each a ring
    all-reduce's 2(N-1) alpha), for the course's MLP on the setting's link."""
    n, link = setting["world_size"], formulas.LINKS[setting["network"]]
    module = formulas.meta_model()
    extra = len(formulas.bucket_elements(module, 0)) - len(formulas.bucket_elements(module, 1.0))
    return extra, 1e3 * extra * 2 * (n - 1) * link.alpha


def _ref_03(setting, sweep=None, *_, strategy: str = "bucketed", **__):
    """The alpha-beta formula: cap 0 takes the cap-1 step (as measured in ``sweep``) plus the link's
    latency for its extra messages; the bytes are the same."""
    if sweep is None:
        return None
    base = statistics.median(sweep[(strategy, 1)])
    return faster_by(base, base + _extra_latency_ms(setting)[1])


def _read_03(setting, sweep, strategy: str = "bucketed"):
    """Notebook 03's sweep: ``{(strategy, cap): [ms per round]}``."""
    n = setting["world_size"]
    times = {CAP1: statistics.median(sweep[(strategy, 1)]), CAP0: statistics.median(sweep[(strategy, 0)])}
    extra, latency = _extra_latency_ms(setting)
    terms = [Term(f"the link's latency for {extra} more messages, {extra} x 2(N-1) alpha", latency),
             Term("the bytes on the link: the same 8.04 MiB either way", 0.0)]
    times_terms = remainder(times[CAP0] - times[CAP1], terms,
                            f"each of the {extra} messages' own work beyond the link (launch, transport, wake-up)",
                            1e-6)
    return Measured(faster_by(times[CAP1], times[CAP0]), times_terms, "ms", times=times, world_size=n,
                    network=setting["network"], note=f"{strategy}: the median over the sweep's rounds")


# --------------------------------------------------------------------------- 04 torch's buckets
def _ref_04(setting, *_, **__):
    return len(formulas.bucket_elements(formulas.meta_model(), None))


def _read_04(setting, trace, step: int = 1):
    """torch DDP's all-reduces in its second recorded step (after the rebuild), from the records."""
    from ddpkit.trace import as_trace, launch_order

    trace = as_trace(trace)
    launched = launch_order(trace, 0, trace.steps[step], name="all_reduce")
    terms = [Term(f"bucket {i}: {c.nbytes / MiB:.2f} MiB", 1.0) for i, c in enumerate(launched)]
    readings = [Term("one bucket for all 8.04 MiB, as in its first step", 1.0),
                Term("one all-reduce per tensor, as naive DDP", 66.0),
                Term("8.04 MiB in 1 MiB buckets", 9.0)]
    return Measured(float(len(launched)), terms or [Term("no all-reduce recorded", 0.0)], "collectives",
                    readings, world_size=trace.world_size, note=f"rank 0, step {trace.steps[step]}")


# --------------------------------------------------------------------------- 04, 08 overlap
OVERLAPPED, BUCKETED = "overlapped", "bucketed"


def _read_04_overlap(setting, gain, parts, ideal=None):
    """Notebook 04's timing rounds ``gain`` ({strategy: [ms]}) and the recorded runs' ``parts``
    ({strategy: step_breakdown(...).parts}); ``ideal`` ({strategy: ms}) is the reference's."""
    times = {s: statistics.median(gain[s]) for s in (OVERLAPPED, BUCKETED)}
    terms = parts_terms(parts[OVERLAPPED], parts[BUCKETED], PART_LABELS)
    return _faster(OVERLAPPED, BUCKETED, times, terms, setting["world_size"], setting["network"],
                   "ms per step: the timing rounds' medians; the parts: the recorded runs (step_breakdown)")


# --------------------------------------------------------------------------- 05 ZeRO
def _ref_05_optim(setting, *_, **__):
    return formulas.zero1_optimizer_state(setting["world_size"]) / MiB


def _read_05_optim(setting, results, rank: int = 0):
    """``run_strategy("zero1", optimizer="adamw", record=True)``'s results, one per rank."""
    n = setting["world_size"]
    mem = _field(results[rank], "memory")
    psi = sum(formulas.param_sizes(formulas.meta_model())) // 4
    half = 4 * psi / n / MiB
    terms = remainder(mem["optimizer_state"] / MiB, [Term("exp_avg, 4 bytes x Psi / N", half),
                                                      Term("exp_avg_sq, 4 bytes x Psi / N", half)],
                      "padding the buckets to a multiple of N")
    readings = [Term("DDP's, unsharded: K Psi with K = 8", 8 * psi / MiB),
                Term("one of AdamW's two moments", half),
                Term("the ZeRO paper's mixed-precision K = 12 (with an fp32 master copy)", 12 * psi / n / MiB),
                Term("the whole model state under ZeRO-1, not the optimizer's part", (8 * psi + 8 * psi / n) / MiB)]
    return Measured(mem["optimizer_state"] / MiB, terms, "MiB", readings, world_size=n,
                    note=f"rank {rank}, measured mid-step (ddpkit.memory)")


def _read_05_fsdp(setting, trace):
    m = bytes_sent(trace, MiB)
    n = m.world_size
    ddp = formulas.ddp_bytes(n) / MiB
    m.readings += [Term("DDP's: one all-reduce of the gradients (FSDP without resharding after forward)", ddp),
                   Term("the gradients' reduce-scatter alone", ddp / 2)]
    return m


# --------------------------------------------------------------------------- 06 ZeRO-1's bytes
def _ref_06(setting, *_, **__):
    return formulas.zero1_bytes(setting["world_size"], setting["model_kwargs"], setting["bucket_cap_mb"]) / MiB


def _read_06(setting, records, strategy: str = "zero1"):
    """``compare`` records (or ``run_strategy`` results): ``comm_bytes_per_step`` of ``strategy``, its
    terms from the ring formulas."""
    n = setting["world_size"]
    row = next(r for r in records if _field(r, "strategy") == strategy)
    module = formulas.meta_model(setting["model_kwargs"])
    s = 4 * formulas.padded_elements(formulas.bucket_elements(module, setting["bucket_cap_mb"]), n)
    count = _field(row, "collectives_per_step")
    sizes = {"reduce_scatter": (round(count.get("reduce_scatter", 0)), s),
             "all_gather": (round(count.get("all_gather", 0)), s)}
    sent = _field(row, "comm_bytes_per_step") / MiB
    terms = remainder(sent, ring_terms(sizes, n, MiB), "other collectives")
    ddp = formulas.ddp_bytes(n, setting["model_kwargs"]) / MiB
    readings = [Term("1.5x DDP's: an all-reduce and then an all-gather, as the sharded_optimizer does", 1.5 * ddp),
                Term("half DDP's: only the reduce-scatter", ddp / 2)]
    return Measured(sent, terms, "MiB", readings, world_size=n, note="compare's recorded run, rank 0")


# --------------------------------------------------------------------------- 07 the cost model's check
FSDP = "fsdp"


def _read_07(setting, checked):
    """``costmodel.validate`` records: measured ms per step of each, and the model's account of them."""
    by = {r["strategy"]: r for r in checked if "error" not in r}
    a, b = by[OVERLAPPED], by[FSDP]
    times = {OVERLAPPED: a["measured_ms"], FSDP: b["measured_ms"]}
    terms = [Term("compute in the model, each wrapper's own host work with it", b["compute_ms"] - a["compute_ms"]),
             Term("exposed communication in the model", b["exposed_comm_ms"] - a["exposed_comm_ms"])]
    return _faster(OVERLAPPED, FSDP, times, terms, setting["world_size"], setting["network"],
                   "measured: validate's timing rounds; the terms: the cost model's own step",
                   rest="what the model did not predict")


def _ref_07(setting, checked=None, *_, predicted=None, **__):
    if checked is not None:
        predicted = {r["strategy"]: r["predicted_ms"] for r in checked if "error" not in r}
    return _predicted(setting, predicted=predicted)


# --------------------------------------------------------------------------- 08 no_sync
EVERY8, EVERY1 = "sync every 8", "sync every 1"


def _skipped_link_ms(setting) -> float:
    """The link's time for one step's all-reduces (1 MiB buckets of the course's MLP), 7 in 8 of
    which an iteration synchronising every 8th skips."""
    n, link = setting["world_size"], formulas.LINKS[setting["network"]]
    buckets = formulas.bucket_elements(formulas.meta_model(), 1.0)
    return sum(1e3 * formulas.collective_time("all_reduce", 4 * t, n, link) for t in buckets)


def _read_08(setting, per_iteration):
    """Notebook 08's ``{every: [ms per iteration, per round]}``."""
    times = {EVERY8: statistics.median(per_iteration[8]), EVERY1: statistics.median(per_iteration[1])}
    sync_ms = _skipped_link_ms(setting)
    terms = [Term(f"7 in 8 iterations' all-reduces skipped: 7/8 x {sync_ms:.1f} ms of link time", 7 / 8 * sync_ms)]
    return _faster(EVERY8, EVERY1, times, terms, setting["world_size"], setting["network"],
                   "ms per iteration: the median over the rounds (the slowest rank's)",
                   rest="the rest: 7 in 8 optimizer steps skipped, less the link time backward hid")


def _ref_08(setting, per_iteration=None, *_, **__):
    """The alpha-beta formula: an iteration synchronising every 8th (as measured) plus 7/8 of one
    step's link time is what synchronising every iteration costs."""
    if per_iteration is None:
        return None
    base = statistics.median(per_iteration[8])
    return faster_by(base, base + 7 / 8 * _skipped_link_ms(setting))


# --------------------------------------------------------------------------- 09 hybrid sharding
def _ref_09(setting, *_, **__):
    return formulas.hsdp_inter_node_bytes(setting["world_size"], setting["ranks_per_node"],
                                          setting["model_kwargs"]) / MiB


def _read_09(setting, result):
    """``run_strategy("hsdp", record=True)``'s result of the rank sending most across nodes."""
    n, k = setting["world_size"], setting["ranks_per_node"]
    w = n // k
    module = formulas.meta_model(setting["model_kwargs"])
    units = formulas.unit_elements(module)
    m = 4 * sum(units)
    sent = _field(result, "inter_node_bytes_per_step") / MiB
    terms = remainder(sent, [Term(f"each unit's shard all-reduced across the {w} nodes: 2(W-1)/W x M/G, "
                                  f"M = {m / MiB:.2f} MiB, G = {k}", 2 * (w - 1) / w * m / k / MiB)],
                      "padding each unit to a multiple of G")
    readings = [Term("FSDP's bytes: 3 x (N-1)/N x M, all of them across nodes", 3 * (n - 1) / n * m / MiB),
                Term("DDP's all-reduce of the whole model across nodes", 2 * (w - 1) / w * m / MiB)]
    return Measured(sent, terms, "MiB", readings, world_size=n, network=setting["network"],
                    note="the rank sending most across nodes, per step")


# --------------------------------------------------------------------------- 10 a parted collective
def _read_10(setting, error, rank: int = 1):
    """A ``DesyncError`` (or its ``diagnosis``): what ``rank`` issued where the ranks parted."""
    diagnosis = getattr(error, "diagnosis", error)
    entry = diagnosis.issued[rank]
    elements = entry.nbytes // 4
    terms = [Term(f"{elements} float32 elements x 4 bytes: its all-reduce of the gradients", float(entry.nbytes))]
    readings = [Term("4 bytes: the loss, which only rank 0 all-reduces", 4.0)]
    return Measured(float(entry.nbytes), terms, "B", readings, world_size=len(diagnosis.ranks),
                    note=f"collective #{diagnosis.index} of the default group, rank {rank}")


# --------------------------------------------------------------------------- 12 your own model
def _ref_12(setting, *_, **__):
    return formulas.fsdp_model_state(setting["world_size"], setting["model"]) / MiB


def _read_12(setting, records, strategy: str = "fsdp"):
    """``compare`` records: the model state of the rank holding the most under ``strategy``."""
    row = next(r for r in records if _field(r, "strategy") == strategy)
    mem = max(_field(row, "memory"), key=lambda m: m["parameters"] + m["gradients"] + m["optimizer_state"])
    terms = memory_terms(mem, ("parameters", "gradients", "optimizer_state"), MiB)
    total = sum(t.value for t in terms)
    n, module = setting["world_size"], setting["model"]
    psi_tied = sum(p.numel() for _, p in module.named_parameters(remove_duplicate=False))
    psi = sum(formulas.param_sizes(module)) // 4
    readings = [Term("the tied head counted twice", 12 * psi_tied / n / MiB),
                Term("DDP's, nothing sharded: 12 bytes x Psi", 12 * psi / MiB),
                Term("parameters only", 4 * psi / n / MiB)]
    return Measured(total, terms, "MiB", readings, world_size=n, note="the rank holding the most, mid-step")


# --------------------------------------------------------------------------- the list
def _q(key, text, unit, quantity, read, reference=None, kind="number", options=(), hint="",
       reference_from="the formulas", **setting):
    if kind == "faster":
        setting["options"] = options
    return Question(key, text, unit, quantity, kind, tuple(options), setting, reference, read, hint, reference_from)


QUESTIONS: dict[str, Question] = {q.key: q for q in [
    _q("01.one_vs_many",
       "One all-reduce of 4 MiB, or 64 all-reduces of 64 KiB (the same 4 MiB), on these {world_size} ranks: "
       "which takes less time, and by how much?", "%", "time", _read_01, _ref_01, "faster", (ONE, MANY),
       hint="Each message pays the latency alpha; every byte pays beta.",
       reference_from="the alpha-beta line fitted to this machine above", world_size=2),
    _q("02.naive_bytes",
       "How many bytes does each rank send per step with NaiveDDP on {world_size} ranks? (the MLP: 8.04 MiB of "
       "fp32 gradients in 66 tensors)", "MiB", "bytes", _read_trace_bytes, _ref_ddp_bytes,
       hint="A ring all-reduce of S bytes on N ranks: each rank sends 2(N-1)/N x S.", world_size=2),
    _q("03.bucketed_bytes",
       "With 1 MiB buckets (8 all-reduces instead of naive's 66), how many bytes does each rank send per step "
       "on {world_size} ranks?", "MiB", "bytes", _read_trace_bytes, _ref_ddp_bytes, world_size=2),
    _q("03.cap1_vs_cap0",
       "On the \"{network}\" network, BucketedDDP with a 1 MiB cap (8 all-reduces a step) or a cap of 0 (66): "
       "which step is faster, and by how much?", "%", "time", _read_03, _ref_03, "faster", (CAP1, CAP0),
       hint="The same bytes either way; count the messages.",
       reference_from="the alpha-beta formula on the link (from the cap-1 time)", world_size=2, network="paper"),
    _q("04.torch_buckets",
       "After its first step torch's DDP rebuilds its buckets (default cap 25 MiB, the first bucket 1 MiB): "
       "how many all-reduces does it issue in its second step?", "collectives", "count", _read_04, _ref_04,
       world_size=2),
    _q("04.overlapped_vs_bucketed",
       "On the \"{network}\" link with 1 MiB buckets: OverlappedDDP or BucketedDDP, which step is faster, "
       "and by how much?", "%", "time", _read_04_overlap, _ideal, "faster", (OVERLAPPED, BUCKETED),
       hint="What can hide under backward, and what does the hook add to backward on these cores?",
       reference_from="the ideal steps printed from the measured forward, backward and step: overlap's best, "
                      "with no hook work and no bytes to move at the wait (else the cost model)",
       world_size=2, network="matched"),
    _q("05.zero1_optimizer_state",
       "Under ZeRO-1 on {world_size} ranks, how much optimizer state (AdamW, fp32) does rank 0 hold? "
       "(the MLP: 2.1 M parameters, 8.04 MiB in fp32)", "MiB", "memory", _read_05_optim, _ref_05_optim,
       world_size=2),
    _q("05.fsdp_bytes",
       "How many bytes does each rank send per step under FSDP (reshard_after_forward=True) on {world_size} "
       "ranks? (DDP sends 8.04 MiB there)", "MiB", "bytes", _read_05_fsdp, _ref_fsdp_bytes, world_size=2),
    _q("06.zero1_bytes",
       "ZeRO-1 on {world_size} ranks, the 0.27 M-parameter MLP (1.01 MiB of gradients; DDP sends 1.01 MiB a step): "
       "how many bytes does each rank send per step?", "MiB", "bytes", _read_06, _ref_06, world_size=2,
       model_kwargs={"width": 128, "depth": 16}, bucket_cap_mb=0.25),
    _q("07.overlapped_vs_fsdp",
       "{world_size} ranks on the emulated \"{network}\": OverlappedDDP or FSDP, which step is faster, "
       "and by how much?", "%", "time", _read_07, _ref_07, "faster", (OVERLAPPED, FSDP),
       hint="FSDP sends 1.5x DDP's bytes, in three collectives per unit.", reference_from="the cost model",
       world_size=4, network="10GbE"),
    _q("08.every8_vs_every1",
       "On the \"{network}\" network: synchronising every 8th iteration (no_sync for the 7 before it) or every "
       "iteration, which is faster per iteration, and by how much?", "%", "time", _read_08, _ref_08, "faster",
       (EVERY8, EVERY1), reference_from="the alpha-beta formula on the link (from the every-8 time)",
       world_size=2, network="paper"),
    _q("09.hsdp_inter_node_bytes",
       "Hybrid sharding on {world_size} ranks in nodes of {ranks_per_node} (a 2.0 MiB model): how many bytes "
       "does a rank send across nodes per step?", "MiB", "bytes", _read_09, _ref_09, world_size=4,
       ranks_per_node=2, network="paper", model_kwargs={"width": 256, "depth": 8}),
    _q("10.parted_bytes",
       "Only rank 0 all-reduces the loss it logs. In the collective where the ranks part, how many bytes does "
       "rank 1 issue?", "B", "bytes", _read_10, lambda setting, *_, **__: 4000.0, world_size=2),
    _q("11.strong_bytes_4",
       "Strong scaling at {world_size} ranks (1 MiB buckets): how many bytes does each rank send per step? "
       "(8.04 MiB of gradients; at 2 ranks each sent 8.04 MiB)", "MiB", "bytes", _read_trace_bytes,
       _ref_ddp_bytes, world_size=4),
    _q("12.fsdp_state",
       "FSDP on your GPT-2 ({world_size} ranks, SGD with momentum): how much model state (parameters, gradients, "
       "optimizer state) does each rank hold?", "MiB", "memory", _read_12, _ref_12,
       hint="Count the tied head once.", world_size=2, model=None),
]}


def question(key: str) -> Question:
    """The course's question ``key``; a KeyError naming the valid keys."""
    try:
        return QUESTIONS[key]
    except KeyError:
        raise KeyError(f"no question {key!r}; the course asks: {', '.join(QUESTIONS)}") from None
