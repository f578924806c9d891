"""Measuring this machine: one rank's compute (a Profile), collective timings, and the lines fitted to them.

``profile_model`` times one process's step per layer; ``profile_job`` does it inside every rank
at once. ``measure_collectives`` times each collective back to back at several sizes and
``fit_link`` fits each its own alpha-beta line (``Link.per_op``), keeping the timings too.
``python -m ddpkit predict --fit`` and ``--validate`` (``costmodel.validate``) use them.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from functools import partial

from ddpkit.costmodel.simulate import Layer, MiB, Profile
from ddpkit.network import RING_STEPS, Link, collective_time, ring_terms


# --------------------------------------------------------------------------- compute profile
def profile_model(module, inputs, targets=None, optimizer: str = "sgd", repeats: int = 5,
                  units=None, loss=None) -> Profile:
    """One process's step on ``module`` (medians of ``repeats``): per-layer forward (hooks, scaled to
    the hookless forward), backward shared out likewise, optimizer step, a bucketed DDP's copies
    (``copy_s_per_byte``). The optimizer steps: pass a model you do not need afterwards."""
    import torch

    from ddpkit.experiment import make_optimizer
    from ddpkit.models import supervised_loss
    from ddpkit.strategies.table import fsdp_units

    batch, loss = (inputs, loss) if loss is not None else ((inputs, targets), supervised_loss)

    dev = next(module.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    seen: set = set()
    owners = []  # (name, module, [param bytes]) for modules that own parameters directly
    for name, m in module.named_modules():
        own = [p for p in m.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            owners.append((name, m, [p.numel() * p.element_size() for p in own]))
    unit_of = {}
    for unit in fsdp_units(module, units):
        uname = next(n for n, m in module.named_modules() if m is unit)
        for m in unit.modules():
            unit_of[id(m)] = uname

    opt = make_optimizer(module.parameters(), optimizer)
    params = [p for p in module.parameters() if p.requires_grad]
    flat = torch.empty(sum(p.numel() for p in params), device=dev)
    slots = flat.split([p.numel() for p in params])
    totals = {"forward": [], "backward": [], "step": [], "copy": []}
    for _ in range(repeats + 1):  # the first is a warmup
        sync()
        t0 = time.perf_counter()
        value = loss(module, batch)
        sync()
        t1 = time.perf_counter()
        value.backward()
        sync()
        t2 = time.perf_counter()
        for p, slot in zip(params, slots, strict=True):  # what a bucketed DDP does with each gradient:
            if p.grad is not None:              # scale it into its bucket slot ...
                torch.mul(p.grad.reshape(-1), 0.5, out=slot)
        for p, slot in zip(params, slots, strict=True):  # ... and copy the slot back out
            if p.grad is not None:
                p.grad.view(-1).copy_(slot)
        sync()
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t4 = time.perf_counter()
        for k, v in zip(totals, (t1 - t0, t2 - t1, t4 - t3, t3 - t2), strict=True):
            totals[k].append(v)
    med = {k: statistics.median(v[1:]) for k, v in totals.items()}

    starts, fwd = {}, {name: [] for name, _, _ in owners}  # each layer's share of the forward
    handles = []
    for name, m, _ in owners:
        handles.append(m.register_forward_pre_hook(lambda mod, a, n=name: starts.__setitem__(n, time.perf_counter())))
        handles.append(m.register_forward_hook(
            lambda mod, a, o, n=name: fwd[n].append(time.perf_counter() - starts[n])))
    try:
        for _ in range(repeats + 1):
            loss(module, batch)
            sync()
    finally:
        for h in handles:
            h.remove()
    layer_fwd = {n: statistics.median(v[1:]) if len(v) > 1 else 0.0 for n, v in fwd.items()}
    total = sum(layer_fwd.values()) or 1.0
    layers = [Layer(name, pb, med["forward"] * layer_fwd[name] / total,
                    med["backward"] * layer_fwd[name] / total, unit_of.get(id(m), ""))
              for name, m, pb in owners]
    return Profile(layers, med["step"], copy_s_per_byte=med["copy"] / (2 * flat.numel() * flat.element_size()))


def profile_job(workload="mlp", batch_per_rank: int = 32, optimizer: str = "sgd",
                model_kwargs: dict | None = None, repeats: int = 5) -> Profile:
    """A Cluster job: ``profile_model`` on every rank at once, contending for the cores as in training."""
    from ddpkit.rankside import device
    from ddpkit.workload import Workload

    wl = Workload.of(workload, model_kwargs)
    module = wl.build().to(device())
    batch = wl.local_batch(0, batch_per_rank, 0, 1, device())
    return profile_model(module, batch, optimizer=optimizer, repeats=repeats, loss=wl.compute_loss)


def profile_for(workload, batch_per_rank: int, optimizer: str = "sgd", model_kwargs: dict | None = None,
                ranks: int | None = None, threads: int | None = None) -> Profile:
    """One rank's compute: profiled here, or inside ``ranks`` ranks at once (the slowest), sharing the cores."""
    if ranks is None:
        return profile_job(workload, batch_per_rank, optimizer, model_kwargs)
    from ddpkit.cluster import Cluster

    with Cluster(ranks, backend="auto", threads_per_rank=threads) as cluster:
        return slowest_profile(cluster.run(profile_job, workload, batch_per_rank, optimizer, model_kwargs))


def slowest_profile(profiles: list[Profile]) -> Profile:
    """The rank whose forward and backward took longest: every rank waits for it."""
    return max(profiles, key=lambda p: p.forward_s + p.backward_s)


def median_profile(profiles: list[Profile]) -> Profile:
    """The profile whose compute total is the median of ``profiles`` (one per round)."""
    ranked = sorted(profiles, key=lambda p: p.forward_s + p.backward_s + p.optimizer_s)
    return ranked[len(ranked) // 2]


# --------------------------------------------------------------------------- the wrappers' own work
def wrapper_job(runs: dict, workload="mlp", batch_per_rank: int = 32, optimizer: str = "sgd",
                bucket_cap_mb: float | None = None, model_kwargs: dict | None = None, steps: int = 5) -> dict:
    """A Cluster job: each of ``runs`` (``{label: (strategy, options)}``) trained alone on every rank at
    once; ``{label: median seconds per step}``: the wrapper's own host work beyond ``profile_job``'s."""
    import torch
    import torch.distributed as dist

    from ddpkit.experiment import train_batch, wrap
    from ddpkit.rankside import device, subgroup
    from ddpkit.workload import Workload

    wl = Workload.of(workload, model_kwargs)
    rank = dist.get_rank()
    alone = [subgroup([r]) for r in range(dist.get_world_size())][rank]  # every rank makes every group
    dev = device()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    per_step = {}
    for label, (name, options) in runs.items():
        model, opt = wrap(name, wl.build(0), optimizer, bucket_cap_mb, process_group=alone, options=options)
        times = []
        for step in range(steps + 1):  # the first is a warmup
            batch = wl.local_batch(step, batch_per_rank, 0, 1, dev)
            t0 = time.perf_counter()
            train_batch(model, opt, batch, wl.compute_loss)
            sync()
            times.append(time.perf_counter() - t0)
        per_step[label] = statistics.median(times[1:])
    return per_step


# --------------------------------------------------------------------------- collectives
CALIBRATION_SIZES = (1024, 16 * 1024, 256 * 1024, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)


def calibration_sizes(largest_bytes: float) -> tuple[int, ...]:
    """``CALIBRATION_SIZES`` up to twice ``largest_bytes`` (e.g. a model's parameter bytes), at least three."""
    sizes = [s for s in CALIBRATION_SIZES if s <= 2 * largest_bytes]
    return tuple(sizes) if len(sizes) >= 3 else CALIBRATION_SIZES[:3]

def model_calibration_sizes(workload="mlp", model_kwargs: dict | None = None) -> tuple[int, ...]:
    """``calibration_sizes`` for this workload's parameter bytes."""
    from ddpkit.workload import Workload

    module = Workload.of(workload, model_kwargs).build()
    return calibration_sizes(sum(p.numel() * p.element_size() for p in module.parameters()))


def measure_collectives(ops=("all_reduce", "all_gather", "reduce_scatter"), sizes=CALIBRATION_SIZES[:6],
                        repeats: int = 3, calls_bytes: float = 32 * MiB) -> dict:
    """A Cluster job: ``{op: [(bytes, median seconds per call)]}``, calls back to back in rows of about
    ``calls_bytes`` (alpha then holds each call's host cost), after a warm-up, the emulation off."""
    import torch.distributed as dist

    from ddpkit import rankside

    comm = rankside.comm()
    with comm.real_transport() if comm is not None else contextlib.nullcontext():
        return _time_collectives(ops, sizes, repeats, calls_bytes, rankside.device(), dist.get_world_size())


def _time_collectives(ops, sizes, repeats: int, calls_bytes: float, dev, n: int, between=None) -> dict:
    """Each collective at each size in rows of calls; ``between``: work before each call, its time taken off."""
    import torch
    import torch.distributed as dist

    from ddpkit.rankside import barrier
    from ddpkit.torch_internals import all_gather_flat, reduce_scatter_flat

    unknown = [op for op in ops if op not in ("all_reduce", "all_gather", "reduce_scatter")]
    if unknown:
        raise ValueError(f"cannot measure {unknown}; valid: all_reduce, all_gather, reduce_scatter")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def row(calls: int, launch=None) -> float:  # seconds per call, in a row, every rank starting together
        barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            if between is not None:
                between()
            if launch is not None:
                launch().wait()
        sync()
        return (time.perf_counter() - t0) / calls

    out: dict = {op: [] for op in ops}
    for op in ops:
        for size in sizes:
            numel = max(n, size // 4) // n * n  # divisible by N, as the sharded collectives need
            full = torch.zeros(numel, device=dev)
            shard = torch.zeros(numel // n, device=dev)
            launch = {"all_reduce": partial(dist.all_reduce, full, async_op=True),
                      "all_gather": partial(all_gather_flat, full, shard, async_op=True),
                      "reduce_scatter": partial(reduce_scatter_flat, shard, full, async_op=True)}[op]
            launch().wait()  # warm-up, untimed
            calls = max(4, min(32, int(calls_bytes // max(size, 1))))
            times = [row(calls, launch) - (row(calls) if between is not None else 0.0) for _ in range(repeats)]
            out[op].append((numel * 4, statistics.median(times)))
    return out


def compute_chunk(seconds: float):
    """Inside a rank: a function computing about ``seconds`` on one core (256 x 256 matrix products)."""
    import torch
    import torch.distributed as dist

    from ddpkit.rankside import barrier

    a = torch.randn(256, 256)

    def work(count: int) -> None:
        for _ in range(count):
            a @ a

    count = 1
    for r in range(dist.get_world_size()):
        barrier()
        if r == dist.get_rank():
            work(5)  # warm-up
            t0 = time.perf_counter()
            work(20)
            count = max(1, round(seconds / ((time.perf_counter() - t0) / 20)))
    barrier()
    return partial(work, count)


def measure_emulated(ops=("all_reduce", "all_gather", "reduce_scatter"), sizes=(4 * 1024, 256 * 1024),
                     repeats: int = 3, compute_s: float = 0.5e-3) -> dict:
    """A Cluster job: ``{op: [(bytes, median seconds per call)]}`` on the emulated network, each call
    after ``compute_s`` of compute (taken off), so ranks reach it apart as in training and pay the
    emulator's wake-ups, which ``emulation_overhead`` compares with the model. ``compute_s=0``: calls
    back to back, the ranks in step (as naive DDP's, each issued when the last is waited for)."""
    import torch.distributed as dist

    from ddpkit.rankside import device

    between = compute_chunk(compute_s) if compute_s > 0 and device().type == "cpu" else None
    return _time_collectives(ops, sizes, repeats, 4 * MiB, device(), dist.get_world_size(), between)


def emulation_overhead(timings: dict, network, world_size: int) -> float:
    """Median seconds (>= 0) a ``measure_emulated`` collective took beyond ``network.collective_time``
    (the slower of floor and link): what the model adds to every emulated collective waited for."""
    extra = [t - network.collective_time(op, size, world_size) for op, rows in timings.items() for size, t in rows]
    return max(0.0, statistics.median(extra)) if extra else 0.0


def measure_all_reduce(sizes=(4 * 1024, 64 * 1024, 1 * MiB, 4 * MiB, 16 * MiB), repeats: int = 3) -> list:
    """A Cluster job: ``[(bytes, seconds)]`` for all-reduces in a row (``measure_collectives``)."""
    return measure_collectives(("all_reduce",), sizes, repeats)["all_reduce"]


def _fit_line(samples, op: str, world_size: int) -> tuple[float, float]:
    """alpha, beta (>= 0) of one collective's line, fitted for relative error (weights 1/t^2)."""
    messages = ring_terms(op, 0, world_size)[0]
    xs = [ring_terms(op, s, world_size)[1] for s, _ in samples]
    ys = [t for _, t in samples]
    ws = [1 / (t * t) if t > 0 else 0.0 for t in ys]
    sw = sum(ws)
    if not sw:
        raise ValueError(f"{op}: every timing is 0")
    mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / sw
    my = sum(w * y for w, y in zip(ws, ys, strict=True)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True)) / sxx if sxx else 0.0
    beta = max(slope, 0.0)
    alpha = max(my - beta * mx, 0.0) / messages
    return alpha, beta


def fit_link(samples, world_size: int, name: str = "fitted", host: bool = False, transport: str = "") -> Link:
    """A Link fitted to timings on N ranks (all-reduces, or ``{op: ...}``: a line per op, ``per_op``),
    kept in ``measured``; fitted for relative error, else least squares would leave alpha at zero."""
    if world_size < 2:
        raise ValueError("fitting needs at least 2 ranks: one rank does not communicate")
    by_op = samples if isinstance(samples, dict) else {"all_reduce": samples}
    for op, rows in by_op.items():
        if op not in RING_STEPS:
            raise ValueError(f"unknown collective {op!r}; valid: {', '.join(RING_STEPS)}")
        if len({s for s, _ in rows}) < 2:
            raise ValueError(f"fitting {op} needs timings at two sizes or more")
    per_op = {op: _fit_line(rows, op, world_size) for op, rows in by_op.items()}
    alpha, beta = per_op.get("all_reduce", next(iter(per_op.values())))
    measured = {op: tuple(sorted((float(s), float(t)) for s, t in rows)) for op, rows in by_op.items()}
    return Link(name, alpha=alpha, beta=beta, per_op=per_op if len(per_op) > 1 else {},
                measured=measured, measured_world_size=world_size, host=host, transport=transport)


def slowest_rank(per_rank: list[dict]) -> dict:
    """``measure_collectives`` from every rank -> the slowest rank's time per (op, size)."""
    return {op: [max(col, key=lambda st: st[1]) for col in zip(*(r[op] for r in per_rank), strict=True)]
            for op in per_rank[0]}

def format_fit(network: Link) -> str:
    """Each collective's fitted line, and the timings it was fitted to (``network.measured``)."""
    n = network.measured_world_size
    lines = [f"fitted on {n} ranks (collectives timed in a row, slowest rank):"]
    for op, rows in network.measured.items():
        alpha, beta = network.alpha_beta(op)
        lines.append(
            f"  {op:<14} alpha {alpha * 1e6:7.1f} us, {1e-9 / beta if beta else float('inf'):6.2f} GB/s;  "
            + "  ".join(f"{size / 1024:.0f} {sec * 1e3:.2f}/{collective_time(op, size, n, network) * 1e3:.2f}"
                        for size, sec in rows) + "  (KiB measured/fitted ms)")
    return "\n".join(lines)
