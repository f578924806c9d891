"""The course's byte, memory and count questions (notebooks 02-06, 09-12), each declared once: its
words (figures derived from the model), its reader (-> ``Measured``) and its exact reference.
"""
from __future__ import annotations

import math

from ddpkit.predictions import formulas
from ddpkit.predictions.question import Question, Setting
from ddpkit.predictions.reading import Measured, Term, bytes_sent, memory_terms, remainder, ring_terms
from ddpkit.units import human_bytes

MiB = 2**20
DDP = formulas.ours("DDP", overlap=True)
FSDP = formulas.ours("ZeRO-3")
TORCH_ZERO = formulas.ours("ZeRO-1", torch=True)
STATE = ("parameters", "gradients", "optimizer_state")


def field(row, name: str):
    """A field of a run's result: ``run_strategy``'s ``RunResult``, or a ``compare`` record (a dict)."""
    return row[name] if isinstance(row, dict) else getattr(row, name)


def row_of(records, strategy: str):
    """``strategy``'s record among ``compare``'s (or ``run_strategy`` results)."""
    return next(r for r in records if field(r, "strategy") == strategy)


def mlp_facts(setting: Setting) -> dict[str, str]:
    return formulas.mlp_facts(setting.model_kwargs)


# --------------------------------------------------------------------------- 02, 03: bytes in a trace
def read_trace_bytes(setting: Setting, trace) -> Measured:
    """A recorded run's ``Trace`` (``cluster.last_trace``): rank 0's bytes sent in its last step."""
    return bytes_sent(trace, MiB)


NAIVE_BYTES = Question(
    key="02.naive_bytes", unit="MiB", quantity="bytes", setting=Setting(world_size=2), facts=mlp_facts,
    text="How many bytes does each rank send per step with NaiveDDP on {world_size} ranks? (the MLP: {gradients} "
         "of fp32 gradients in {tensors} tensors)",
    hint="Each gradient is all-reduced once. Notebook 01's ring all-reduce is a reduce-scatter, then an "
         "all-gather: follow one rank's piece of a tensor through both.",
    read=read_trace_bytes, reference=lambda s: formulas.ddp_bytes(s.world_size) / MiB,
    reference_from="the ring formula, 2(N-1)/N x S")

BUCKETED_BYTES = Question(
    key="03.bucketed_bytes", unit="MiB", quantity="bytes", setting=Setting(world_size=2), facts=mlp_facts,
    text="With 1 MiB buckets ({buckets} all-reduces instead of naive's {tensors}), how many bytes does each rank "
         "send per step on {world_size} ranks?",
    read=read_trace_bytes, reference=lambda s: formulas.ddp_bytes(s.world_size) / MiB,
    reference_from="the ring formula, 2(N-1)/N x S")


# --------------------------------------------------------------------------- 04 torch's buckets
def read_second_step_all_reduces(setting: Setting, trace, *, step: int = 1) -> Measured:
    """torch DDP's recorded ``Trace``: its all-reduces in the second recorded step (after the rebuild)."""
    from ddpkit.trace import as_trace, launch_order

    trace = as_trace(trace)
    launched = launch_order(trace, 0, trace.steps[step], name="all_reduce")
    terms = [Term(f"bucket {i}: {c.nbytes / MiB:.2f} MiB", 1.0) for i, c in enumerate(launched)]
    sizes = formulas.param_sizes(formulas.meta_model())
    s = human_bytes(sum(sizes))
    readings = [Term(f"one bucket for all {s}, as in its first step", 1.0),
                Term("one all-reduce per tensor, as naive DDP", float(len(sizes))),
                Term(f"{s} cut into 1 MiB pieces", float(math.ceil(sum(sizes) / MiB)))]
    return Measured(float(len(launched)), terms or [Term("no all-reduce recorded", 0.0)], "collectives",
                    readings, world_size=trace.world_size, note=f"rank 0, step {trace.steps[step]}")


TORCH_BUCKETS = Question(
    key="04.torch_buckets", unit="collectives", quantity="count", setting=Setting(world_size=2),
    text="After its first step torch's DDP rebuilds its buckets (default cap 25 MiB, the first bucket 1 MiB): "
         "how many all-reduces does it issue in its second step?",
    read=read_second_step_all_reduces,
    reference=lambda s: float(len(formulas.bucket_elements(formulas.meta_model(), None))),
    reference_from="torch's bucket layout over the MLP's gradients (ddpkit.strategies.buckets)")


# --------------------------------------------------------------------------- 05 ZeRO-1's state, FSDP's bytes
def read_state_share(setting: Setting, zero1: list, ddp: list) -> Measured:
    """``run_strategy(..., optimizer="adamw", record=True)``'s results, one per rank, of ZeRO-1 and
    of DDP: rank 0's model state under ZeRO-1 over DDP's, by category."""
    ours, theirs = field(zero1[0], "memory"), field(ddp[0], "memory")
    whole = sum(theirs[c] for c in STATE)
    n = setting.world_size
    terms = [Term(f"{c.replace('_', ' ')}: {human_bytes(ours[c])} of DDP's {human_bytes(whole)}", ours[c] / whole)
             for c in STATE]
    g, o = theirs["gradients"] / whole, theirs["optimizer_state"] / whole
    readings = [Term(f"everything sharded, 1/N = 1/{n}", 1 / n),
                Term("gradients sharded too (ZeRO-2)", 1 - (g + o) * (n - 1) / n),
                Term("nothing sharded", 1.0)]
    return Measured(sum(t.value for t in terms), terms, "x", readings, world_size=n,
                    note="rank 0, measured mid-step (ddpkit.memory)")


ZERO1_STATE = Question(
    key="05.zero1_state_share", unit="x", quantity="memory", setting=Setting(world_size=2), facts=mlp_facts,
    text="ZeRO-1 on {world_size} ranks, AdamW in fp32, the MLP ({parameters} parameters): the model state one "
         "rank keeps (parameters, gradients, optimizer state), as a multiple of what it keeps under DDP?",
    hint="Under DDP a rank keeps 4 bytes of parameters, 4 of gradients and 8 of AdamW's moments per parameter.",
    read=read_state_share,
    reference=lambda s: formulas.zero1_model_state(s.world_size) / formulas.ddp_model_state(),
    reference_from="the ZeRO paper's formulas over the kit's buckets")


def read_bytes_against(setting: Setting, trace, ddp_sent: float) -> Measured:
    """A recorded run's ``Trace`` and DDP's bytes per step (``comm_bytes_per_step``, one rank's):
    rank 0's bytes per step over DDP's, by collective."""
    m = bytes_sent(trace, 1.0)
    terms = [Term(t.label, t.value / ddp_sent) for t in m.terms]
    readings = [Term("FSDP's, resharding after forward: two all-gathers and a reduce-scatter", 1.5),
                Term("half DDP's: the reduce-scatter alone", 0.5)]
    return Measured(m.value / ddp_sent, terms, "x", readings, world_size=m.world_size,
                    note=f"{m.note}; DDP's {human_bytes(ddp_sent)} a step from its own run")


NO_RESHARD = Question(
    key="05.no_reshard_bytes", unit="x", quantity="bytes", setting=Setting(world_size=2),
    text="FSDP with reshard_after_forward=False on {world_size} ranks: the bytes each rank sends per step, as a "
         "multiple of DDP's?",
    hint="Per unit: which collectives does FSDP run in forward and in backward, and which of them does a "
         "parameter kept from forward to backward make unnecessary?",
    read=read_bytes_against,
    reference=lambda s: formulas.fsdp_bytes(s.world_size, reshard=False) / formulas.ddp_bytes(s.world_size),
    reference_from="the ring formulas over FSDP's padded units")


# --------------------------------------------------------------------------- 06 torch's ZeroRedundancyOptimizer
def read_compare_bytes(setting: Setting, records: list) -> Measured:
    """``compare``'s records: torch's ZeroRedundancyOptimizer's bytes per step over DDP's, by the ring
    formulas' terms."""
    sent = field(row_of(records, TORCH_ZERO), "comm_bytes_per_step")
    ddp = field(row_of(records, DDP), "comm_bytes_per_step")
    n, module = setting.world_size, formulas.meta_model(setting.model_kwargs)
    sizes, buckets = formulas.param_sizes(module), len(formulas.bucket_elements(module, None))
    terms = remainder(sent / ddp, [Term(t.label, t.value / ddp) for t in ring_terms(
        {"all_reduce": (buckets, sum(sizes)), "broadcast": (len(sizes), sum(sizes))}, n, 1.0)],
        "other collectives (torch's DDP broadcasts its rebuilt bucket order once, after its first step)")
    readings = [Term("DDP's: as ZeRO-1, a reduce-scatter and an all-gather", 1.0),
                Term("a broadcast sending all of S from every rank", 1 + n / (2 * (n - 1)))]
    return Measured(sent / ddp, terms, "x", readings, world_size=n, note="compare's recorded runs, rank 0")


TORCH_ZERO_BYTES = Question(
    key="06.torch_zero_bytes", unit="x", quantity="bytes",
    setting=Setting(world_size=2, model_kwargs={"width": 128, "depth": 16}),
    text="torch's ZeroRedundancyOptimizer (over its DDP) on {world_size} ranks: the bytes each rank sends per step, "
         "as a multiple of DDP's?",
    hint="After its step, each rank owns the new values of its parameters; torch's optimizer broadcasts each "
         "parameter from the rank that owns it.",
    read=read_compare_bytes,
    reference=lambda s: formulas.torch_zero_bytes(s.world_size, s.model_kwargs) / formulas.ddp_bytes(
        s.world_size, s.model_kwargs),
    reference_from="the ring formulas (a broadcast: (N-1)/N x S per rank, network.ring_bytes)")


# --------------------------------------------------------------------------- 09 hybrid sharding
def read_cross_node_share(setting: Setting, hsdp, fsdp) -> Measured:
    """``run_strategy(..., record=True)``'s results of the rank sending most across nodes, of hsdp
    and of fsdp: hsdp's bytes across nodes over FSDP's."""
    n, k = setting.world_size, setting.ranks_per_node
    w = n // k
    m = 4 * sum(formulas.unit_elements(formulas.meta_model(setting.model_kwargs)))
    theirs = field(fsdp, "inter_node_bytes_per_step")
    share = field(hsdp, "inter_node_bytes_per_step") / theirs
    terms = remainder(share, [Term(f"each unit's shard all-reduced across the {w} nodes: 2(W-1)/W x M/G, "
                                   f"M = {human_bytes(m)}, G = {k}", 2 * (w - 1) / w * m / k / theirs)],
                      "padding each unit to a multiple of G")
    readings = [Term(f"1/G = 1/{k}: a node's shard", 1 / k), Term("one of FSDP's three collectives", 1 / 3)]
    return Measured(share, terms, "x", readings, world_size=n, network=setting.network,
                    note=f"the rank sending most across nodes, per step; FSDP's {human_bytes(theirs)}")


HSDP_SHARE = Question(
    key="09.hsdp_cross_node_share", unit="x", quantity="bytes",
    setting=Setting(world_size=4, ranks_per_node=2, network="paper", model_kwargs={"width": 256, "depth": 8}),
    text="Hybrid sharding on {world_size} ranks in nodes of {ranks_per_node}: the bytes a rank sends across nodes "
         "per step, as a multiple of what it sends across them under FSDP?",
    read=read_cross_node_share,
    reference=lambda s: formulas.hsdp_inter_node_bytes(s.world_size, s.ranks_per_node, s.model_kwargs)
    / formulas.fsdp_bytes(s.world_size, s.model_kwargs),
    reference_from="the FSDP paper's 2M(W-1)/(GW) over the ring formulas for FSDP")


# --------------------------------------------------------------------------- 10 a parted collective
PARTED_ELEMENTS = 1000   # notebook 10's job all-reduces torch.ones(1000) as its "gradients"


def read_parted_collective(setting: Setting, error, *, rank: int = 1) -> Measured:
    """A ``DesyncError`` (or its ``diagnosis``): what ``rank`` issued where the ranks parted."""
    diagnosis = getattr(error, "diagnosis", error)
    entry = diagnosis.issued[rank]
    terms = [Term(f"{entry.nbytes // 4} float32 elements x 4 bytes: its all-reduce of the gradients",
                  float(entry.nbytes))]
    readings = [Term("4 bytes: the loss, which only rank 0 all-reduces", 4.0)]
    return Measured(float(entry.nbytes), terms, "B", readings, world_size=len(diagnosis.ranks),
                    note=f"collective #{diagnosis.index} of the default group, rank {rank}")


PARTED = Question(
    key="10.parted_bytes", unit="B", quantity="bytes", setting=Setting(world_size=2),
    text="Only rank 0 all-reduces the loss it logs. In the collective where the ranks part, how many bytes does "
         "rank 1 issue?",
    read=read_parted_collective, reference=lambda s: 4.0 * PARTED_ELEMENTS,
    reference_from="rank 1's first collective in the job's code")


# --------------------------------------------------------------------------- 11 bytes as N grows
def read_growth(setting: Setting, trace_n, trace_2) -> Measured:
    """Two recorded runs' ``Trace``s of the same job, at ``world_size`` ranks and at 2: rank 0's
    bytes per step at N over at 2, by the ring terms at N."""
    at_n, at_2 = bytes_sent(trace_n, 1.0), bytes_sent(trace_2, 1.0)
    terms = [Term(t.label, t.value / at_2.value) for t in at_n.terms]
    n = at_n.world_size
    readings = [Term(f"N/2 = {n}/2: the bytes grow with the ranks", n / 2), Term("the same at any N", 1.0),
                Term(f"shared out, 2/N = 2/{n}", 2 / n)]
    return Measured(at_n.value / at_2.value, terms, "x", readings, world_size=n,
                    note=f"rank 0, the last step of each run; at 2 ranks: {human_bytes(at_2.value)}")


GROWTH = Question(
    key="11.bytes_growth", unit="x", quantity="bytes", setting=Setting(world_size=4), facts=mlp_facts,
    text="Strong scaling, OverlappedDDP, the MLP ({gradients} of gradients): from 2 to {world_size} ranks, by what "
         "factor do the bytes each rank sends per step grow?",
    read=read_growth, reference=lambda s: formulas.ddp_bytes(s.world_size) / formulas.ddp_bytes(2),
    reference_from="the ring formula, 2(N-1)/N x S at each N")


# --------------------------------------------------------------------------- 12 your own model
def read_model_state(setting: Setting, records: list) -> Measured:
    """``compare``'s records: the model state of the rank holding the most under FSDP."""
    mem = max(field(row_of(records, FSDP), "memory"), key=lambda m: sum(m[c] for c in STATE))
    terms = memory_terms(mem, STATE, MiB)
    n, module = setting.world_size, setting.model
    psi_tied = sum(p.numel() for _, p in module.named_parameters(remove_duplicate=False))
    psi = sum(formulas.param_sizes(module)) // 4
    readings = [Term("the tied head counted twice", 12 * psi_tied / n / MiB),
                Term("DDP's, nothing sharded: 12 bytes x Psi", 12 * psi / MiB),
                Term("parameters only", 4 * psi / n / MiB)]
    return Measured(sum(t.value for t in terms), terms, "MiB", readings, world_size=n,
                    note="the rank holding the most, mid-step")


FSDP_STATE = Question(
    key="12.fsdp_state", unit="MiB", quantity="memory", setting=Setting(world_size=2), needs=("model",),
    text="FSDP on your GPT-2 ({world_size} ranks, SGD with momentum): how much model state (parameters, gradients, "
         "optimizer state) does each rank hold?",
    hint="GPT-2's output head shares its weight with the token embedding.",
    read=read_model_state, reference=lambda s: formulas.fsdp_model_state(s.world_size, s.model) / MiB,
    reference_from="the ZeRO paper's 16 Psi / N with K = 4 (SGD's momentum), over FSDP's padded units")

QUESTIONS = [NAIVE_BYTES, BUCKETED_BYTES, TORCH_BUCKETS, ZERO1_STATE, NO_RESHARD, TORCH_ZERO_BYTES, HSDP_SHARE,
             PARTED, GROWTH, FSDP_STATE]
