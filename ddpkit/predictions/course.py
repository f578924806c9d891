"""The course's questions, one per measurement it asks the learner to predict (notebooks 01-12).

Each ``Question`` says what is asked, in which unit, its reference answer (``formulas``, or the
cost model's times) and how its measuring cell's results are read (a ``reading.Measured``):

    ddpkit.ask("02.naive_bytes")                 # before the measuring cell (ddpkit.predictions.asking)
    ...the measuring cell...
    q.reveal(trace)                              # after it: read, scored, taken apart, kept

``QUESTIONS`` is the one list of them, by key ("<notebook>.<name>"); how each is read and answered
lives in ``times.py`` (which is faster) and ``counts.py`` (bytes, memory, counts).
``tests/test_predictions.py`` checks every reference against a measurement of its own setting.
"""
from __future__ import annotations

from ddpkit.predictions import counts, times
from ddpkit.predictions.question import Question


# --------------------------------------------------------------------------- the list
def _q(key, text, unit, quantity, read, reference=None, kind="number", options=(), hint="",
       reference_from="the formulas", **setting):
    if kind == "faster":
        setting["options"] = options
    return Question(key, text, unit, quantity, kind, tuple(options), setting, reference, read, hint, reference_from)


QUESTIONS: dict[str, Question] = {q.key: q for q in [
    _q("01.one_vs_many",
       "One all-reduce of 4 MiB, or 64 all-reduces of 64 KiB (the same 4 MiB), on these {world_size} ranks: "
       "which takes less time, and by how much?", "%", "time", times.read_01, times.ref_01, "faster",
       (times.ONE, times.MANY),
       hint="Each message pays the latency alpha; every byte pays beta.",
       reference_from="the alpha-beta line fitted to this machine above", world_size=2),
    _q("02.naive_bytes",
       "How many bytes does each rank send per step with NaiveDDP on {world_size} ranks? (the MLP: 8.04 MiB of "
       "fp32 gradients in 66 tensors)", "MiB", "bytes", counts.read_trace_bytes, counts.ref_ddp_bytes,
       hint="A ring all-reduce of S bytes on N ranks: each rank sends 2(N-1)/N x S.", world_size=2),
    _q("03.bucketed_bytes",
       "With 1 MiB buckets (8 all-reduces instead of naive's 66), how many bytes does each rank send per step "
       "on {world_size} ranks?", "MiB", "bytes", counts.read_trace_bytes, counts.ref_ddp_bytes, world_size=2),
    _q("03.cap1_vs_cap0",
       "On the \"{network}\" network, BucketedDDP with a 1 MiB cap (8 all-reduces a step) or a cap of 0 (66): "
       "which step is faster, and by how much?", "%", "time", times.read_03, times.ref_03, "faster",
       (times.CAP1, times.CAP0),
       hint="The same bytes either way; count the messages.",
       reference_from="the alpha-beta formula on the link (from the cap-1 time)", world_size=2, network="paper"),
    _q("04.torch_buckets",
       "After its first step torch's DDP rebuilds its buckets (default cap 25 MiB, the first bucket 1 MiB): "
       "how many all-reduces does it issue in its second step?", "collectives", "count", counts.read_04, counts.ref_04,
       world_size=2),
    _q("04.overlapped_vs_bucketed",
       "On the \"{network}\" link with 1 MiB buckets: OverlappedDDP or BucketedDDP, which step is faster, "
       "and by how much?", "%", "time", times.read_04_overlap, times.ref_04_overlap, "faster",
       (times.OVERLAPPED, times.BUCKETED),
       hint="What can hide under backward, and what does the hook add to backward on these cores?",
       reference_from="the ideal steps printed from the measured forward, backward and step: overlap's best, "
                      "with no hook work and no bytes to move at the wait (else the cost model)",
       world_size=2, network="matched"),
    _q("05.zero1_optimizer_state",
       "Under ZeRO-1 on {world_size} ranks, how much optimizer state (AdamW, fp32) does rank 0 hold? "
       "(the MLP: 2.1 M parameters, 8.04 MiB in fp32)", "MiB", "memory", counts.read_05_optim, counts.ref_05_optim,
       world_size=2),
    _q("05.fsdp_bytes",
       "How many bytes does each rank send per step under FSDP (reshard_after_forward=True) on {world_size} "
       "ranks? (DDP sends 8.04 MiB there)", "MiB", "bytes", counts.read_05_fsdp, counts.ref_fsdp_bytes, world_size=2),
    _q("06.zero1_bytes",
       "ZeRO-1 on {world_size} ranks, the 0.27 M-parameter MLP (1.01 MiB of gradients; DDP sends 1.01 MiB a step): "
       "how many bytes does each rank send per step?", "MiB", "bytes", counts.read_06, counts.ref_06, world_size=2,
       model_kwargs={"width": 128, "depth": 16}, bucket_cap_mb=0.25),
    _q("07.overlapped_vs_fsdp",
       "{world_size} ranks on the emulated \"{network}\": OverlappedDDP or FSDP, which step is faster, "
       "and by how much?", "%", "time", times.read_07, times.ref_07, "faster", (times.OVERLAPPED, times.FSDP),
       hint="FSDP sends 1.5x DDP's bytes, in three collectives per unit.", reference_from="the cost model",
       world_size=4, network="1GbE"),
    _q("08.every8_vs_every1",
       "On the \"{network}\" network: synchronising every 8th iteration (no_sync for the 7 before it) or every "
       "iteration, which is faster per iteration, and by how much?", "%", "time", times.read_08, times.ref_08, "faster",
       (times.EVERY8, times.EVERY1), reference_from="the alpha-beta formula on the link (from the every-8 time)",
       world_size=2, network="paper"),
    _q("09.hsdp_inter_node_bytes",
       "Hybrid sharding on {world_size} ranks in nodes of {ranks_per_node} (a 2.0 MiB model): how many bytes "
       "does a rank send across nodes per step?", "MiB", "bytes", counts.read_09, counts.ref_09, world_size=4,
       ranks_per_node=2, network="paper", model_kwargs={"width": 256, "depth": 8}),
    _q("10.parted_bytes",
       "Only rank 0 all-reduces the loss it logs. In the collective where the ranks part, how many bytes does "
       "rank 1 issue?", "B", "bytes", counts.read_10, lambda setting, *_, **__: 4000.0, world_size=2),
    _q("11.strong_bytes_4",
       "Strong scaling at {world_size} ranks (1 MiB buckets): how many bytes does each rank send per step? "
       "(8.04 MiB of gradients; at 2 ranks each sent 8.04 MiB)", "MiB", "bytes", counts.read_trace_bytes,
       counts.ref_ddp_bytes, world_size=4),
    _q("12.fsdp_state",
       "FSDP on your GPT-2 ({world_size} ranks, SGD with momentum): how much model state (parameters, gradients, "
       "optimizer state) does each rank hold?", "MiB", "memory", counts.read_12, counts.ref_12,
       hint="Count the tied head once.", world_size=2, model=None),
]}


def question(key: str) -> Question:
    """The course's question ``key``; a KeyError naming the valid keys."""
    try:
        return QUESTIONS[key]
    except KeyError:
        raise KeyError(f"no question {key!r}; the course asks: {', '.join(QUESTIONS)}") from None
