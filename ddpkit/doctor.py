"""``python -m ddpkit doctor``: what an instructor runs first on the lab machine.

It starts one Cluster where ``backend="auto"`` puts it (NCCL with a GPU per rank; with fewer GPUs
than ranks, the ranks sharing them over ddpkit's own transport; without a GPU, gloo on the CPU;
``gpus=`` as a Cluster takes it, ``[0, 0]`` for two ranks sharing GPU 0), says which, and
exercises, on tiny models and few steps, every feature the notebooks use: every strategy and
torch's own wrappers (each must equal one process), recording and streaming, the emulated
network, memory statistics and a small comparison. One row per feature, ``ok`` or ``FAILED``
with the last line of the error; the exit status is 1 on any failure, and the last line says how long
it took (``docs/classroom.md``: what that was on a small machine).

    python -m ddpkit doctor                     # the first GPUs (or the CPU), 2 ranks
    python -m ddpkit doctor --gpus 4,5          # a student's pair of GPUs
    python -m ddpkit doctor --world-size 4 --gpus 0,0,0,0   # 4 ranks sharing GPU 0

From Python (a notebook, a test): ``doctor(cluster=..., only=[...], checks=[...], out=...)``.
"""
from __future__ import annotations

import math
import os
import platform
import time
import traceback
from collections import Counter
from dataclasses import dataclass

from ddpkit.strategies.table import DEFAULT, NAMES, STRATEGIES, unfit
from ddpkit.torch_internals import supported_range, torch_problem
from ddpkit.units import human_bytes

TINY = dict(width=32, depth=3)  # the MLP: 4 Linears, ~2.5k parameters
STEPS, WARMUP = 2, 1
BUCKET_CAP_MB = 0.002  # ~2 kB: the tiny model still fills several buckets


@dataclass
class Context:
    """What the checks share: the cluster, the single-process reference and its tolerance."""

    cluster: object
    batch: int
    reference: dict
    tolerance: float
    start_s: float | None = None  # how long the cluster took to start (None: it was given)

    def run_strategy(self, name: str, **kwargs) -> list:
        """``experiment.run_strategy`` on every rank: a ``RunResult`` each."""
        from ddpkit.experiment import run_strategy

        common = dict(steps=STEPS, warmup=WARMUP, global_batch_size=self.batch, model_kwargs=TINY,
                      bucket_cap_mb=BUCKET_CAP_MB, reference=self.reference, report_progress=False)
        return self.cluster.run(run_strategy, name, **{**common, **kwargs})

    def equal_to_one_process(self, results: list) -> str:
        diff = max(r.max_param_diff for r in results)
        if not diff <= self.tolerance:  # NaN fails too
            raise AssertionError(f"differs from one process by {diff:.3g} (tolerance {self.tolerance:g})")
        return f"equals one process (max |diff| {diff:.1e})"


# ----------------------------------------------------------------------------- the checks
def _strategy(name: str):
    def check(ctx: Context) -> str:
        results = ctx.run_strategy(name)
        if not all(math.isfinite(loss) for r in results for loss in r.losses):
            raise AssertionError(f"a loss is not finite: {[r.losses for r in results]}")
        return ctx.equal_to_one_process(results)

    return check


def _rank() -> int:
    import ddpkit

    return ddpkit.rank()


def _on_gpu(cluster) -> bool:
    """Do the cluster's ranks run on GPUs (a GPU each under NCCL, or sharing them)?"""
    return any(d.startswith("cuda") for d in cluster.devices)


def _cluster(ctx: Context) -> str:
    c = ctx.cluster
    ranks = c.run(_rank)
    if ranks != list(range(c.world_size)):
        raise AssertionError(f"the ranks answered {ranks}")
    started = f" (started in {ctx.start_s:.1f} s)" if ctx.start_s is not None else ""
    return f"{c.world_size} ranks on {c.carried_by}: {', '.join(c.devices)}{started}"


def _recording(ctx: Context) -> str:
    c = ctx.cluster
    with c.recording():
        results = ctx.run_strategy(DEFAULT)
    ctx.equal_to_one_process(results)
    records = c.last_trace.records
    ranks = {r.rank for r in records}
    if ranks != set(range(c.world_size)):
        raise AssertionError(f"records streamed from ranks {sorted(ranks)} of {c.world_size}")
    collectives = [r for r in records if r.cat == "comm"]
    if not collectives or any(r.end_ns is None or r.end_ns < r.start_ns for r in collectives):
        raise AssertionError(f"{len(collectives)} collectives recorded, some without a completion time")
    kinds = {r.cat for r in records}
    missing = {"comm", "compute", "loss", "memory", "grad_ready"} - kinds
    if missing:
        raise AssertionError(f"no {', '.join(sorted(missing))} records streamed")
    clocks = sorted({r.clock for r in collectives})
    if _on_gpu(c) and clocks != ["cuda"]:
        raise AssertionError(f"collectives timed by the {clocks} clock, not CUDA events: {_host_timed(collectives)}")
    return f"{len(records)} records from {len(ranks)} ranks, collectives on the {'/'.join(clocks)} clock"


def _timed_all_reduce(nbytes: int) -> float:
    import torch
    import torch.distributed as dist

    import ddpkit
    from ddpkit.rankside import barrier

    dev = ddpkit.device()
    finish = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    t = torch.ones(nbytes // 4, device=dev)
    dist.all_reduce(t)  # warm-up
    barrier()
    finish()
    t0 = time.perf_counter()
    dist.all_reduce(t, async_op=True).wait()
    finish()
    return time.perf_counter() - t0


def _network(ctx: Context) -> str:
    from ddpkit.network import Network

    c = ctx.cluster
    net, nbytes = Network("1GbE"), 2**20
    expected = net.collective_time("all_reduce", nbytes, c.world_size)
    c.network = net
    try:
        took = max(c.run(_timed_all_reduce, nbytes))
        results = ctx.run_strategy(DEFAULT)  # backward's hooks, on the emulated link
    finally:
        c.network = None
    ctx.equal_to_one_process(results)
    if c.world_size > 1 and took < 0.9 * expected:
        raise AssertionError(f"a 1 MiB all-reduce on emulated 1GbE took {took * 1e3:.1f} ms, "
                             f"the link alone {expected * 1e3:.1f} ms")
    return f"1 MiB all-reduce on 1GbE: {took * 1e3:.1f} ms (the link: {expected * 1e3:.1f} ms)"


def _memory(ctx: Context) -> str:
    # the table's ZeRO-2 row: gradients and optimizer state sharded, parameters whole
    name = next(name for name, row in STRATEGIES.items() if row.zero_stage == "ZeRO-2")
    results = ctx.run_strategy(name, record=True)
    sample = results[0].memory
    empty = [k for k in ("parameters", "gradients", "optimizer_state") if not sample.get(k)]
    if empty:
        raise AssertionError(f"no bytes measured for {', '.join(empty)}: {sample}")
    if _on_gpu(ctx.cluster) and not sample.get("cuda_allocated"):
        raise AssertionError(f"no CUDA allocator statistics on a GPU: {sample}")
    peak = max(r.peak_bytes for r in results)
    if not peak > 0:
        raise AssertionError(f"peak {peak} bytes")
    cuda = " (CUDA allocator)" if "cuda_allocated" in sample else ""
    if "cuda_context" in sample:  # what each rank's process holds outside the allocator: its CUDA context
        cuda += f"; {human_bytes(sample['cuda_context'], 0)} outside it (the CUDA context) per rank"
    state = sample["parameters"] + sample["gradients"] + sample["optimizer_state"]
    return f"{name} rank 0: {human_bytes(state, 1)} of model state, peak {human_bytes(peak, 1)}{cuda}"


def _compare(ctx: Context) -> str:
    from ddpkit.compare import compare, format_table, torch_reference

    pair = [NAMES[0], torch_reference(NAMES[0])]  # the simplest strategy and torch's wrapper of its family
    records = compare(ctx.cluster, pair, model_kwargs=TINY, steps=STEPS, rounds=1,
                      global_batch_size=ctx.batch, bucket_cap_mb=BUCKET_CAP_MB, record_steps=STEPS)
    errors = [r["error"] for r in records if "error" in r]
    if errors:
        raise AssertionError(errors[0])
    format_table(records)  # the table the CLI prints must format
    diff = max(r["max_param_diff"] for r in records)
    if not diff <= ctx.tolerance:
        raise AssertionError(f"a compared strategy differs from one process by {diff:.3g}")
    ratio = records[0].get("vs_torch")
    return " vs ".join(pair) + (f": {ratio:.2f}x" if ratio is not None else "")


def _host_timed(collectives) -> str:
    """Which collectives a CUDA run timed on the host clock: name, size, step (None: setup)."""
    seen = Counter((r.name, r.nbytes, r.step, r.end_ns == r.start_ns) for r in collectives if r.clock != "cuda")
    return "; ".join(f"{name} {nbytes} B step {step}{' (0 ns)' if zero else ''} x{k}"
                     for (name, nbytes, step, zero), k in seen.most_common(4))


def _nccl_one_rank(ctx: Context) -> str:
    """On a machine with one GPU the main cluster runs on gloo: NCCL is checked at 1 rank."""
    import ddpkit

    with ddpkit.Cluster(1, backend="nccl") as one:
        alone = Context(one, ctx.batch, ctx.reference, 1e-4)  # one rank: the whole batch
        with one.recording():
            alone.equal_to_one_process(alone.run_strategy(DEFAULT))
        collectives = [r for r in one.last_trace.records if r.cat == "comm"]
    if not collectives or any(r.clock != "cuda" for r in collectives):
        raise AssertionError(f"{len(collectives)} collectives recorded, not all on CUDA events: "
                             f"{_host_timed(collectives)}")
    return f"recorded {DEFAULT} run, {len(collectives)} collectives on CUDA events"


def default_checks(world_size: int, one_gpu_only: bool = False) -> list[tuple[str, object]]:
    """(name, check) in the order they run: each check takes the Context and returns a detail."""
    skip = unfit(NAMES, [world_size])
    checks = [("cluster", _cluster)]
    checks += [(f"strategy {name}", _strategy(name)) for name in NAMES if name not in skip]
    checks += [("recording + streaming", _recording), ("emulated network", _network),
               ("memory statistics", _memory), ("compare", _compare)]
    if one_gpu_only:
        checks.append(("NCCL at 1 rank", _nccl_one_rank))
    return checks


# ----------------------------------------------------------------------------- running them
def last_line(exc: BaseException) -> str:
    """The line of an error that says what went wrong: a rank's last traceback line, else the
    exception's own last line (with its type)."""
    failures = getattr(exc, "failures", None)
    if failures:  # a RankError: what the first failing rank raised
        text = next(iter(failures.values()))
    else:
        text = "".join(traceback.format_exception_only(type(exc), exc))
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


# the hosted notebooks, known by the environment variables their kernels are given
RUNTIMES = {"Colab": ("COLAB_RELEASE_TAG", "COLAB_GPU"), "Kaggle": ("KAGGLE_KERNEL_RUN_TYPE", "KAGGLE_URL_BASE")}


def runtime(environ=None) -> str:
    """Where this kernel runs: a hosted notebook recognised by its variables, or none."""
    env = os.environ if environ is None else environ
    for name, keys in RUNTIMES.items():
        if any(k in env for k in keys):
            return f"{name} ({', '.join(k for k in keys if k in env)} set)"
    return "no hosted notebook (Colab, Kaggle) recognised"


def machine() -> str:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    where = f"{gpus} CUDA GPU(s): {torch.cuda.get_device_name(0)}" if gpus else "no CUDA GPU"
    inside = "in" if torch_problem() is None else "OUTSIDE"
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None  # the shm transport's segments
    free = f", /dev/shm {human_bytes(shm.f_bavail * shm.f_frsize, 0)} free" if shm else ""
    return (f"torch {torch.__version__} ({inside} the tested range {supported_range()}), "
            f"Python {platform.python_version()}, {os.cpu_count()} CPU cores, {where}{free}; runtime: {runtime()}")


def doctor(world_size: int = 2, gpus=None, only=None, cluster=None, checks=None, out=print) -> int:
    """Run the checks (``default_checks``, or ``checks``: (name, fn(Context)) pairs), those named
    in ``only`` if given, on ``cluster`` (else a Cluster started here and shut down after, on the
    machine's real backend); print one row each through ``out``; return the exit status: 0 when
    every one passed, 1 otherwise."""
    import torch

    import ddpkit
    from ddpkit.experiment import train_single_process

    started = time.perf_counter()
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    own = cluster is None
    ws = world_size if own else cluster.world_size
    one_gpu_short = own and gpus is None and 0 < visible < ws  # 2 ranks, 1 GPU: sharing it, and NCCL at 1 rank
    todo = checks if checks is not None else default_checks(ws, one_gpu_only=one_gpu_short)
    if only is not None:  # before anything starts: a typo costs nothing
        unknown = sorted(set(only) - {name for name, _ in todo})
        if unknown:
            raise ValueError(f"no check called {', '.join(map(repr, unknown))}; the checks: "
                             f"{', '.join(name for name, _ in todo)}")
        todo = [(name, fn) for name, fn in todo if name in only]
    out(f"ddpkit doctor: {machine()}")
    problem = torch_problem()
    if problem:  # a warning, not a crash: the rows below say what works on this torch
        out(f"WARNING: {problem}")
    if own:
        if one_gpu_short:
            out(f"  note: {visible} GPU(s) for {ws} ranks: backend='auto' lets the ranks share the GPU(s), "
                f"each its own process with its own CUDA context ({_sharing(ws)}); NCCL refuses two ranks on "
                "one GPU, so it is checked at 1 rank. Not known from here: whether this runtime lets a process "
                "map another's GPU memory (CUDA IPC); if the rows below fail on it, Cluster(..., transport='shm') "
                "stages the bytes through pinned host memory instead")
        try:
            t0 = time.perf_counter()
            cluster = ddpkit.Cluster(world_size, gpus=gpus)
            start_s = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - reported as the first row
            out(_row(False, "cluster", last_line(exc), time.perf_counter() - started))
            out("the cluster did not start: nothing else can be checked")
            return 1
    batch = 4 * ws
    reference = train_single_process("mlp", "sgd", steps=STEPS + WARMUP, global_batch_size=batch, **TINY)
    # on a GPU the ranks' float32 sums and matrix products differ from the CPU reference's in the last bits
    ctx = Context(cluster, batch, reference, 1e-4 if _on_gpu(cluster) else 1e-5, start_s if own else None)
    failed = 0
    try:
        for name, check in todo:
            t0 = time.perf_counter()
            try:
                detail, ok = check(ctx), True
            except Exception as exc:  # noqa: BLE001 - every failure is a row, and the next check runs
                detail, ok = last_line(exc), False
                if any(r.status == "dead" for r in cluster.ranks):
                    cluster.restart()
            failed += not ok
            out(_row(ok, name, detail, time.perf_counter() - t0))
    finally:
        if own:
            cluster.shutdown()
    total = time.perf_counter() - started
    verdict = f", {failed} FAILED" if failed else ""
    out(f"{len(todo) - failed} of {len(todo)} checks ok{verdict} ({total:.0f} s)")
    return 1 if failed else 0


def _sharing(world_size: int) -> str:
    """What ``backend="auto"`` gives ``world_size`` ranks on this machine, in words (nothing started)."""
    from ddpkit.cluster import check_arguments
    from ddpkit.cluster.placement import carried_by

    s = check_arguments(world_size)
    return carried_by(world_size, s.backend, s.gpus, s.transport)


def _row(ok: bool, name: str, detail: str, seconds: float) -> str:
    return f"  {'ok' if ok else 'FAILED':<7} {name:<28} {seconds:5.1f} s  {detail}"


__all__ = ["Context", "default_checks", "doctor", "last_line", "machine"]
