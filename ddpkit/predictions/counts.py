"""The course's byte, memory and count questions, notebooks 02-06 and 09-12: how each is read from
its measuring cell (``Measured``, split by the ring formula's terms or the memory categories) and its
exact reference from the formulas. The questions themselves are listed in ``course.py``."""
from __future__ import annotations

from ddpkit.predictions import formulas
from ddpkit.predictions.reading import Measured, Term, bytes_sent, memory_terms, remainder, ring_terms

MiB = 2**20


def field(row, name: str):
    """A field of a run's result: ``run_strategy``'s ``RunResult``, or a ``compare`` record (a dict)."""
    return row[name] if isinstance(row, dict) else getattr(row, name)


# --------------------------------------------------------------------------- 02, 03, 05, 11: bytes in a trace
def read_trace_bytes(setting, trace):
    return bytes_sent(trace, MiB)


def ref_ddp_bytes(setting, *_, **__):
    return formulas.ddp_bytes(setting["world_size"]) / MiB


def ref_fsdp_bytes(setting, *_, **__):
    return formulas.fsdp_bytes(setting["world_size"]) / MiB


# --------------------------------------------------------------------------- 04 torch's buckets
def ref_04(setting, *_, **__):
    return len(formulas.bucket_elements(formulas.meta_model(), None))


def read_04(setting, trace, step: int = 1):
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


# --------------------------------------------------------------------------- 05 ZeRO
def ref_05_optim(setting, *_, **__):
    return formulas.zero1_optimizer_state(setting["world_size"]) / MiB


def read_05_optim(setting, results, rank: int = 0):
    """``run_strategy("zero1", optimizer="adamw", record=True)``'s results, one per rank."""
    n = setting["world_size"]
    mem = field(results[rank], "memory")
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


def read_05_fsdp(setting, trace):
    m = bytes_sent(trace, MiB)
    n = m.world_size
    ddp = formulas.ddp_bytes(n) / MiB
    m.readings += [Term("DDP's: one all-reduce of the gradients (FSDP without resharding after forward)", ddp),
                   Term("the gradients' reduce-scatter alone", ddp / 2)]
    return m


# --------------------------------------------------------------------------- 06 ZeRO-1's bytes
def ref_06(setting, *_, **__):
    return formulas.zero1_bytes(setting["world_size"], setting["model_kwargs"], setting["bucket_cap_mb"]) / MiB


def read_06(setting, records, strategy: str = "zero1"):
    """``compare`` records (or ``run_strategy`` results): ``comm_bytes_per_step`` of ``strategy``, its
    terms from the ring formulas."""
    n = setting["world_size"]
    row = next(r for r in records if field(r, "strategy") == strategy)
    module = formulas.meta_model(setting["model_kwargs"])
    s = 4 * formulas.padded_elements(formulas.bucket_elements(module, setting["bucket_cap_mb"]), n)
    count = field(row, "collectives_per_step")
    sizes = {"reduce_scatter": (round(count.get("reduce_scatter", 0)), s),
             "all_gather": (round(count.get("all_gather", 0)), s)}
    sent = field(row, "comm_bytes_per_step") / MiB
    terms = remainder(sent, ring_terms(sizes, n, MiB), "other collectives")
    ddp = formulas.ddp_bytes(n, setting["model_kwargs"]) / MiB
    readings = [Term("1.5x DDP's: an all-reduce and then an all-gather, as the sharded_optimizer does", 1.5 * ddp),
                Term("half DDP's: only the reduce-scatter", ddp / 2)]
    return Measured(sent, terms, "MiB", readings, world_size=n, note="compare's recorded run, rank 0")


# --------------------------------------------------------------------------- 09 hybrid sharding
def ref_09(setting, *_, **__):
    return formulas.hsdp_inter_node_bytes(setting["world_size"], setting["ranks_per_node"],
                                          setting["model_kwargs"]) / MiB


def read_09(setting, result):
    """``run_strategy("hsdp", record=True)``'s result of the rank sending most across nodes."""
    n, k = setting["world_size"], setting["ranks_per_node"]
    w = n // k
    module = formulas.meta_model(setting["model_kwargs"])
    units = formulas.unit_elements(module)
    m = 4 * sum(units)
    sent = field(result, "inter_node_bytes_per_step") / MiB
    terms = remainder(sent, [Term(f"each unit's shard all-reduced across the {w} nodes: 2(W-1)/W x M/G, "
                                  f"M = {m / MiB:.2f} MiB, G = {k}", 2 * (w - 1) / w * m / k / MiB)],
                      "padding each unit to a multiple of G")
    readings = [Term("FSDP's bytes: 3 x (N-1)/N x M, all of them across nodes", 3 * (n - 1) / n * m / MiB),
                Term("DDP's all-reduce of the whole model across nodes", 2 * (w - 1) / w * m / MiB)]
    return Measured(sent, terms, "MiB", readings, world_size=n, network=setting["network"],
                    note="the rank sending most across nodes, per step")


# --------------------------------------------------------------------------- 10 a parted collective
def read_10(setting, error, rank: int = 1):
    """A ``DesyncError`` (or its ``diagnosis``): what ``rank`` issued where the ranks parted."""
    diagnosis = getattr(error, "diagnosis", error)
    entry = diagnosis.issued[rank]
    elements = entry.nbytes // 4
    terms = [Term(f"{elements} float32 elements x 4 bytes: its all-reduce of the gradients", float(entry.nbytes))]
    readings = [Term("4 bytes: the loss, which only rank 0 all-reduces", 4.0)]
    return Measured(float(entry.nbytes), terms, "B", readings, world_size=len(diagnosis.ranks),
                    note=f"collective #{diagnosis.index} of the default group, rank {rank}")


# --------------------------------------------------------------------------- 12 your own model
def ref_12(setting, *_, **__):
    return formulas.fsdp_model_state(setting["world_size"], setting["model"]) / MiB


def read_12(setting, records, strategy: str = "fsdp"):
    """``compare`` records: the model state of the rank holding the most under ``strategy``."""
    row = next(r for r in records if field(r, "strategy") == strategy)
    mem = max(field(row, "memory"), key=lambda m: m["parameters"] + m["gradients"] + m["optimizer_state"])
    terms = memory_terms(mem, ("parameters", "gradients", "optimizer_state"), MiB)
    total = sum(t.value for t in terms)
    n, module = setting["world_size"], setting["model"]
    psi_tied = sum(p.numel() for _, p in module.named_parameters(remove_duplicate=False))
    psi = sum(formulas.param_sizes(module)) // 4
    readings = [Term("the tied head counted twice", 12 * psi_tied / n / MiB),
                Term("DDP's, nothing sharded: 12 bytes x Psi", 12 * psi / MiB),
                Term("parameters only", 4 * psi / n / MiB)]
    return Measured(total, terms, "MiB", readings, world_size=n, note="the rank holding the most, mid-step")
