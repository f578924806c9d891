"""A cost model of data-parallel training: alpha-beta collectives plus a simulated backward pass.

Each collective costs what the ring algorithms cost (PAPERS.md), with alpha the latency of one
message (seconds) and beta the time per byte (seconds per byte, 1 / bandwidth):

    all-reduce of S bytes on N ranks       2(N-1) alpha + 2(N-1)/N S beta
    all-gather / reduce-scatter (full S)    (N-1) alpha +  (N-1)/N S beta

Compute comes from a ``Profile``: per layer, its parameters' bytes and its forward and backward
time (measured with ``profile_model``, or given), plus what one pass over gradient memory costs
(bucketed DDP copies every gradient into its bucket and back). Overlap is *simulated*, not
assumed: backward runs the layers in reverse, a gradient is ready when its layer's backward ends,
a bucket's all-reduce is launched when its last gradient is ready, buckets go in order on one
communication stream, and the step ends when both compute and the stream are done. So a bucket
too small pays alpha too often, a bucket too large waits for the whole backward (the U-shaped
curve of the DDP paper), and overlap cannot hide more than the backward compute there is.

On a real machine, ``measure_collectives`` times each collective back to back at several sizes
and ``fit_network`` fits each its own line (``Network.per_op``). ``python -m ddpkit predict
--validate`` puts the model's predictions beside measured steps; ``python -m ddpkit predict``
prints predictions for any network, and ``plot_scaling`` draws them up to 256 ranks.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field, replace

from ddpkit.strategies.table import NAMES as STRATEGIES
from ddpkit.strategies.table import strategy as strategy_row
from ddpkit.strategies.buckets import assign_buckets  # the same rule the strategies use
from ddpkit.trace import ring_bytes  # bytes one rank sends, by the ring formulas above

MiB = 1024 * 1024

# Messages in a row of the ring algorithm on N ranks: the multiple of alpha a collective pays.
RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1,
              "reduce_scatter": lambda n: n - 1, "broadcast": lambda n: n - 1}


@dataclass(frozen=True)
class Network:
    """A fabric for the alpha-beta model: ``alpha`` seconds per message, ``beta`` seconds per byte.

    ``per_op`` optionally gives some collectives their own ``(alpha, beta)``: ``fit_network``
    fills it when it has timings of several collectives (on gloo over loopback a small
    reduce-scatter costs more than a small all-gather, not the ring formulas' same alpha).

    ``measured`` optionally holds the timings themselves, ``{op: ((bytes, seconds), ...)}`` on
    ``measured_world_size`` ranks: at that size ``collective_time`` interpolates between them
    instead of using the straight line. A machine's curve is not quite a line (on the
    development machine the all-reduce line could miss 16 MiB by 20-35%), but one timing is
    noisier than a line through six: ``predict --validate`` shows both. Every other world size
    uses the lines. ``line()`` is the same network without the timings.
    """

    name: str
    alpha: float
    beta: float
    per_op: dict = field(default_factory=dict, compare=False)
    measured: dict = field(default_factory=dict, compare=False)
    measured_world_size: int = 0

    def __post_init__(self):
        for a, b in [(self.alpha, self.beta), *self.per_op.values()]:
            if not (a >= 0 and b >= 0):
                raise ValueError(f"alpha and beta must be >= 0, got {a}, {b}")
        unknown = (set(self.per_op) | set(self.measured)) - set(RING_STEPS)
        if unknown:
            raise ValueError(f"unknown collective(s) {sorted(unknown)}; valid: {', '.join(RING_STEPS)}")
        if self.measured and self.measured_world_size < 2:
            raise ValueError("measured timings need the world size they were taken on (>= 2)")

    def alpha_beta(self, op: str) -> tuple[float, float]:
        return self.per_op.get(op, (self.alpha, self.beta))

    def line(self) -> "Network":
        """This network's straight lines only, without the measured timings."""
        return replace(self, measured={}, measured_world_size=0)

    @property
    def gbytes_per_s(self) -> float:
        return 1e-9 / self.beta if self.beta else math.inf


# Presets. "loopback" is the all-reduce line fitted on the development machine (2 CPU cores,
# gloo over loopback, collectives timed back to back) by `python -m ddpkit predict --fit
# --fit-ranks 2`: alpha 280-710 us and 1.7-2.3 GB/s over several runs (a small collective's
# latency there drifts from second to second). Fit your own machine the same way. The others are
# round figures for the order of magnitude, not measurements: 100 GbE moves at most 12.5 GB/s,
# ~10 GB/s in practice, with tens of microseconds per message over TCP; NVLink (A100/H100 class)
# moves a few hundred GB/s per GPU, a few microseconds per hop.
NETWORKS = {
    "loopback": Network("loopback", alpha=500e-6, beta=1 / 2e9),
    "100GbE": Network("100GbE", alpha=20e-6, beta=1 / 10e9),
    "nvlink": Network("nvlink", alpha=5e-6, beta=1 / 200e9),
}


# --------------------------------------------------------------------------- collectives
def collective_time(name: str, nbytes: float, world_size: int, network: Network) -> float:
    """Seconds for one ring collective of full size S: steps x alpha + bytes sent x beta, or,
    where ``network`` holds timings of this collective at this world size, interpolated."""
    n = world_size
    if n == 1:
        return 0.0
    steps = RING_STEPS[name](n)
    alpha, beta = network.alpha_beta(name)
    table = network.measured.get(name) if n == network.measured_world_size else None
    if table:
        return _interpolate(table, nbytes, ring_bytes(name, 1.0, n) * beta)
    return steps * alpha + ring_bytes(name, nbytes, n) * beta


def _interpolate(table, nbytes: float, slope: float) -> float:
    """Straight between the two measured sizes around ``nbytes``; below the smallest, its time
    (latency dominates there); above the largest, on from it with the fitted ``slope``."""
    (s0, t0), (s_last, t_last) = table[0], table[-1]
    if nbytes <= s0:
        return t0
    if nbytes >= s_last:
        return t_last + (nbytes - s_last) * slope
    for (a, ta), (b, tb) in zip(table, table[1:]):
        if a <= nbytes <= b:
            return ta if b == a else ta + (tb - ta) * (nbytes - a) / (b - a)
    raise AssertionError("unreachable: table sizes are sorted")


# --------------------------------------------------------------------------- compute profile
@dataclass
class Layer:
    """One module with parameters of its own: their bytes, and its compute time in seconds."""

    name: str
    param_bytes: list[int]          # one entry per parameter tensor, registration order
    forward_s: float
    backward_s: float
    unit: str = ""                  # the FSDP unit it belongs to ("" = the root)


@dataclass
class Profile:
    """The compute of one training step on one rank: layers in forward order, plus the optimizer."""

    layers: list[Layer]
    optimizer_s: float = 0.0        # one optimizer step over every parameter
    elem_bytes: int = 4             # for FSDP padding (fp32)
    copy_s_per_byte: float = 0.0    # one pass over memory (copy_ of a flat buffer), per byte

    @property
    def param_bytes(self) -> int:
        return sum(sum(l.param_bytes) for l in self.layers)

    @property
    def forward_s(self) -> float:
        return sum(l.forward_s for l in self.layers)

    @property
    def backward_s(self) -> float:
        return sum(l.backward_s for l in self.layers)

    def scaled(self, factor: float) -> "Profile":
        """The same model with compute ``factor`` times as long (e.g. a per-rank batch k x larger)."""
        return Profile([Layer(l.name, list(l.param_bytes), l.forward_s * factor, l.backward_s * factor,
                              l.unit) for l in self.layers], self.optimizer_s, self.elem_bytes,
                       self.copy_s_per_byte)

    def copy_s(self, nbytes: float) -> float:
        """Seconds for one pass over ``nbytes`` (a bucket's copy in or out)."""
        return nbytes * self.copy_s_per_byte


def uniform_profile(layers: int, param_bytes: int, forward_ms: float, backward_ms: float | None = None,
                    optimizer_ms: float = 0.0) -> Profile:
    """``layers`` equal layers (one parameter tensor each): the model the tests and examples use."""
    bwd = 2 * forward_ms if backward_ms is None else backward_ms
    return Profile([Layer(f"layer{i}", [param_bytes], forward_ms / 1e3, bwd / 1e3, unit=f"layer{i}")
                    for i in range(layers)], optimizer_ms / 1e3)


def profile_model(module, inputs, targets, optimizer: str = "sgd", repeats: int = 5,
                  units=None) -> Profile:
    """Measure one process's step on ``module``: per-layer forward time (hooks), whole forward,
    backward and optimizer step (median of ``repeats``).

    Backward is not timed per layer (module backward hooks are fragile): each layer gets the
    measured backward total in proportion to its forward time, the usual ~2x rule. Per-layer
    forward times are scaled so they add up to the whole forward (activations, loss included).
    ``units`` are the FSDP units (default: ``models.fsdp_units``). The optimizer steps, so
    pass a model you do not need afterwards. Also timed, right after backward: scaling every
    gradient into a flat buffer and copying it back, tensor by tensor, as bucketed DDP does
    (``copy_s_per_byte`` is half that time per byte: one pass).
    """
    import torch

    from ddpkit.experiment import make_optimizer
    from ddpkit.models import fsdp_units, loss_fn

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
    for unit in (fsdp_units(module) if units is None else units):
        uname = next(n for n, m in module.named_modules() if m is unit)
        for m in unit.modules():
            unit_of[id(m)] = uname

    starts, fwd = {}, {name: [] for name, _, _ in owners}
    handles = []
    for name, m, _ in owners:
        handles.append(m.register_forward_pre_hook(lambda mod, a, n=name: starts.__setitem__(n, time.perf_counter())))
        handles.append(m.register_forward_hook(lambda mod, a, o, n=name: fwd[n].append(time.perf_counter() - starts[n])))
    opt = make_optimizer(module.parameters(), optimizer)
    params = [p for p in module.parameters() if p.requires_grad]
    flat = torch.empty(sum(p.numel() for p in params), device=dev)
    slots = flat.split([p.numel() for p in params])
    totals = {"forward": [], "backward": [], "step": [], "copy": []}
    try:
        for _ in range(repeats + 1):  # the first is a warmup
            sync()
            t0 = time.perf_counter()
            loss = loss_fn(module(inputs), targets)
            sync()
            t1 = time.perf_counter()
            loss.backward()
            sync()
            t2 = time.perf_counter()
            for p, slot in zip(params, slots):  # what a bucketed DDP does with each gradient:
                if p.grad is not None:              # scale it into its bucket slot ...
                    torch.mul(p.grad.reshape(-1), 0.5, out=slot)
            for p, slot in zip(params, slots):      # ... and copy the slot back out
                if p.grad is not None:
                    p.grad.view(-1).copy_(slot)
            sync()
            t3 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            t4 = time.perf_counter()
            for k, v in zip(totals, (t1 - t0, t2 - t1, t4 - t3, t3 - t2)):
                totals[k].append(v)
    finally:
        for h in handles:
            h.remove()
    med = {k: statistics.median(v[1:]) for k, v in totals.items()}
    layer_fwd = {n: statistics.median(v[1:]) if len(v) > 1 else 0.0 for n, v in fwd.items()}
    total = sum(layer_fwd.values()) or 1.0
    layers = [Layer(name, pb, med["forward"] * layer_fwd[name] / total,
                    med["backward"] * layer_fwd[name] / total, unit_of.get(id(m), ""))
              for name, m, pb in owners]
    return Profile(layers, med["step"], copy_s_per_byte=med["copy"] / (2 * flat.numel() * flat.element_size()))


def profile_job(model: str = "mlp", batch_per_rank: int = 32, optimizer: str = "sgd",
                model_kwargs: dict | None = None, repeats: int = 5) -> Profile:
    """A Cluster job: ``profile_model`` on every rank at once, without communicating, so
    ranks that share a machine's cores contend for them as they do in training."""
    import ddpkit
    from ddpkit.experiment import local_batch
    from ddpkit.models import build_model

    module = build_model(model, **(model_kwargs or {})).to(ddpkit.device())
    x, y = local_batch(module, batch_per_rank, 0, 0, 1)
    return profile_model(module, x.to(ddpkit.device()), y.to(ddpkit.device()), optimizer, repeats)


# --------------------------------------------------------------------------- simulation
@dataclass
class Prediction:
    """One predicted step. Times in milliseconds; bytes per rank per step."""

    strategy: str
    world_size: int
    network: str
    ms_per_step: float
    compute_ms: float               # forward + backward + optimizer with no communication
    comm_ms: float                  # time the communication stream is busy
    exposed_comm_ms: float          # ms_per_step - compute_ms: what overlap failed to hide
    comm_bytes_per_step: float
    collectives: int


class _Stream:
    """One communication stream: collectives run one at a time, in the order issued."""

    def __init__(self, world_size: int, network: Network):
        self.n, self.net = world_size, network
        self.free = 0.0
        self.busy = 0.0
        self.bytes = 0.0
        self.count = 0

    def issue(self, name: str, nbytes: float, at: float) -> float:
        """Launch at time ``at`` (or when the stream frees up); returns the completion time."""
        if self.n == 1:
            return at
        start = max(at, self.free)
        dur = collective_time(name, nbytes, self.n, self.net)
        self.free = start + dur
        self.busy += dur
        self.bytes += ring_bytes(name, nbytes, self.n)
        self.count += 1
        return self.free


def _ddp_step(profile: Profile, stream: _Stream, cap_bytes: float, overlap: bool,
              first_cap_bytes: float | None = None) -> float:
    """Forward, backward, then the gradients' all-reduces, on the host's timeline (compute and
    copies, one after another) beside the communication stream. Returns when both are done.

    ``cap_bytes`` 0 is NaiveDDP: after backward, each gradient is scaled in place (one pass over
    its bytes) and all-reduced, one at a time. Otherwise gradients go into buckets: each is
    copied into its bucket slot (scaled, one pass) and copied back after its bucket's all-reduce
    (another pass) -- the two passes every bucketed DDP pays, torch's included unless gradients
    are views of the buckets. With ``overlap`` the copy in happens in the gradient's hook, during
    backward, and a bucket is launched as soon as its last gradient is in; without, all of it
    starts when backward ends.
    """
    flat = [b for layer in profile.layers for b in layer.param_bytes]  # registration order
    t = profile.forward_s
    if cap_bytes == 0:  # naive: in place, one collective per gradient, each awaited
        t += profile.backward_s
        for b in reversed(flat):
            t = stream.issue("all_reduce", b, t + profile.copy_s(b))
        return t
    buckets = assign_buckets(flat, cap_bytes, first_cap_bytes=first_cap_bytes)
    sizes = [sum(flat[i] for i in b) for b in buckets]
    if overlap:
        ready = []  # when each gradient is in its bucket slot, in backward order
        for layer in reversed(profile.layers):  # backward runs the layers in reverse
            t += layer.backward_s
            for b in reversed(layer.param_bytes):  # its hook copies it in, delaying what follows
                t += profile.copy_s(b)
                ready.append(t)
        ready.reverse()  # registration order, as the bucket indices are
        launched = [stream.issue("all_reduce", size, max(ready[i] for i in b))
                    for b, size in zip(buckets, sizes)]
    else:
        t += profile.backward_s
        launched = []
        for size in sizes:  # pack bucket k, launch it, pack bucket k+1 while k is sent
            t += profile.copy_s(size)
            launched.append(stream.issue("all_reduce", size, t))
    for size, done in zip(sizes, launched):  # wait for each in order, copy it back out
        t = max(t, done) + profile.copy_s(size)
    return t


def _fsdp_step(profile: Profile, stream: _Stream, reshard: bool = True, prefetch: bool = True) -> float:
    """ZeRO-3 on one stream: all-gather each unit before forward (and again before backward when
    resharded), reduce-scatter its gradient after its backward, the optimizer over 1/N shards.

    With ``prefetch`` the next unit's all-gather is issued when the current unit's compute starts
    (FSDP's forward and backward prefetch); without, only when the compute needs it.
    """
    n = stream.n
    units: dict[str, list[Layer]] = {}
    for layer in profile.layers:
        units.setdefault(layer.unit, []).append(layer)
    names = [u for u in units if u != ""]
    pad = n * profile.elem_bytes
    size = {u: math.ceil(sum(sum(l.param_bytes) for l in ls) / pad) * pad for u, ls in units.items()}
    fwd = {u: sum(l.forward_s for l in ls) for u, ls in units.items()}
    bwd = {u: sum(l.backward_s for l in ls) for u, ls in units.items()}

    t = 0.0
    if "" in units:  # the root's own parameters: gathered once, kept until its backward
        t = stream.issue("all_gather", size[""], 0.0)
    order = names
    gathered = {}
    for i, u in enumerate(order):
        if u not in gathered:
            gathered[u] = stream.issue("all_gather", size[u], t)
        start = max(t, gathered[u])
        if prefetch and i + 1 < len(order):
            nxt = order[i + 1]
            gathered[nxt] = stream.issue("all_gather", size[nxt], start)
        t = start + fwd[u]
    t += fwd.get("", 0.0)  # root-level compute (embeddings, head) in forward
    t += bwd.get("", 0.0)  # ... and its backward, first
    back = list(reversed(order))
    regathered: dict = {}
    for i, u in enumerate(back):
        if reshard and u not in regathered:
            regathered[u] = stream.issue("all_gather", size[u], t)
        start = max(t, regathered.get(u, t))
        if reshard and prefetch and i + 1 < len(back):
            nxt = back[i + 1]
            regathered[nxt] = stream.issue("all_gather", size[nxt], start)
        t = start + bwd[u]
        stream.issue("reduce_scatter", size[u], t)
    if "" in units:
        stream.issue("reduce_scatter", size[""], t)
    return max(t, stream.free)


def simulate(strategy: str, profile: Profile, world_size: int, network: Network | str = "loopback",
             bucket_cap_mb: float = 25.0) -> Prediction:
    """Predict one training step of ``strategy`` at ``world_size`` ranks on ``network``."""
    step = strategy_row(strategy).cost  # how the table says this strategy communicates
    if isinstance(network, str):
        if network not in NETWORKS:
            raise ValueError(f"unknown network {network!r}; valid: {', '.join(NETWORKS)}")
        network = NETWORKS[network]
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = world_size
    stream = _Stream(n, network)
    opt = profile.optimizer_s / n if step.sharded_optimizer else profile.optimizer_s
    if step.algorithm == "fsdp":
        end = _fsdp_step(profile, stream, reshard=step.reshard, prefetch=step.prefetch) + opt
    else:
        cap = bucket_cap_mb * MiB if step.bucketed else 0  # cap 0: naive, one all-reduce per gradient
        # torch caps its first bucket at 1 MiB when the cap is left at its default
        first = 1 * MiB if step.torch_first_bucket and bucket_cap_mb == 25.0 else None
        end = _ddp_step(profile, stream, cap, overlap=step.overlap, first_cap_bytes=first) + opt
        if step.gather_params:
            # each rank stepped 1/N of the parameters; the updated ones are shared with one
            # all-gather of all P bytes: a copy of our 1/N into the send buffer, the gathered
            # ones back out
            p_bytes = profile.param_bytes
            end = stream.issue("all_gather", p_bytes, end + profile.copy_s(p_bytes / n)) + profile.copy_s(p_bytes)
    compute = profile.forward_s + profile.backward_s + opt
    return Prediction(strategy, n, network.name, end * 1e3, compute * 1e3, stream.busy * 1e3,
                      max(0.0, end - compute) * 1e3, stream.bytes, stream.count)


def predict(profile: Profile, strategies=STRATEGIES, world_sizes=(2, 4, 8), network="loopback",
            bucket_cap_mb: float = 25.0) -> list[Prediction]:
    """Every (strategy, world size) pair, world sizes outermost."""
    return [simulate(s, profile, n, network, bucket_cap_mb) for n in world_sizes for s in strategies]


# --------------------------------------------------------------------------- fitting
CALIBRATION_SIZES = (1024, 16 * 1024, 256 * 1024, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)


def calibration_sizes(largest_bytes: float) -> tuple[int, ...]:
    """The sizes worth timing for collectives of up to ``largest_bytes`` (e.g. a model's
    parameter bytes: the largest bucket, unit or all-gather): ``CALIBRATION_SIZES`` up to twice
    that, at least three of them."""
    sizes = [s for s in CALIBRATION_SIZES if s <= 2 * largest_bytes]
    return tuple(sizes) if len(sizes) >= 3 else CALIBRATION_SIZES[:3]


def measure_collectives(ops=("all_reduce", "all_gather", "reduce_scatter"), sizes=CALIBRATION_SIZES[:6],
                        repeats: int = 3, calls_bytes: float = 32 * MiB) -> dict:
    """A Cluster job: time each collective at each full size S (bytes, fp32) on this rank;
    returns ``{op: [(bytes, seconds per call)]}``, the median of ``repeats``.

    Calls are timed *back to back*, the way a strategy issues them (a barrier before each row,
    none between calls), so alpha includes what each call costs the host: on gloo over loopback
    waking the sending and receiving threads, which on a busy CPU is most of a small collective's
    time (a 4 KiB all-reduce: ~0.2 ms alone after a barrier, 0.4-1.5 ms in a row). A row holds
    about ``calls_bytes`` bytes (4 to 32 calls). Each size runs once untimed first: gloo's first
    collectives on a group pay for connections and buffers.
    """
    import torch
    import torch.distributed as dist

    import ddpkit
    from ddpkit.strategies._common import all_gather_flat, reduce_scatter_flat

    dev, n = ddpkit.device(), dist.get_world_size()
    unknown = [op for op in ops if op not in ("all_reduce", "all_gather", "reduce_scatter")]
    if unknown:
        raise ValueError(f"cannot measure {unknown}; valid: all_reduce, all_gather, reduce_scatter")
    out: dict = {op: [] for op in ops}
    for op in ops:
        for size in sizes:
            numel = max(n, size // 4) // n * n  # divisible by N, as the sharded collectives need
            full = torch.zeros(numel, device=dev)
            shard = torch.zeros(numel // n, device=dev)
            call = {"all_reduce": lambda: dist.all_reduce(full, async_op=True),
                    "all_gather": lambda: all_gather_flat(full, shard, async_op=True),
                    "reduce_scatter": lambda: reduce_scatter_flat(shard, full, async_op=True)}[op]
            call().wait()  # warm-up, untimed
            calls = max(4, min(32, int(calls_bytes // max(size, 1))))
            times = []
            for _ in range(repeats):
                dist.barrier()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    call().wait()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) / calls)
            out[op].append((numel * 4, statistics.median(times)))
    return out


def measure_all_reduce(sizes=(4 * 1024, 64 * 1024, 1 * MiB, 4 * MiB, 16 * MiB), repeats: int = 3) -> list:
    """A Cluster job: ``[(bytes, seconds)]`` for all-reduces in a row (``measure_collectives``)."""
    return measure_collectives(("all_reduce",), sizes, repeats)["all_reduce"]


def _fit_line(samples, op: str, world_size: int) -> tuple[float, float]:
    """alpha, beta for one collective: t = steps x alpha + bytes sent x beta, a straight line in
    S fitted for *relative* error (weights 1/t^2), both kept >= 0."""
    xs = [ring_bytes(op, s, world_size) for s, _ in samples]
    ys = [t for _, t in samples]
    ws = [1 / (t * t) if t > 0 else 0.0 for t in ys]
    sw = sum(ws)
    if not sw:
        raise ValueError(f"{op}: every timing is 0")
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx if sxx else 0.0
    beta = max(slope, 0.0)
    alpha = max(my - beta * mx, 0.0) / RING_STEPS[op](world_size)
    return alpha, beta


def fit_network(samples, world_size: int, name: str = "fitted") -> Network:
    """Fit alpha and beta to collective timings on N ranks: ``[(bytes, seconds)]`` of all-reduces,
    or ``{op: [(bytes, seconds)]}`` as ``measure_collectives`` returns (one rank's, or the slowest
    rank's per size), which fits each collective its own line (``Network.per_op``). The timings
    are kept too (``Network.measured``): at N ranks predictions interpolate them.

    Timings span orders of magnitude (microseconds to tens of milliseconds), so each line is
    fitted for *relative* error; a plain least-squares fit would let the largest size decide
    alone and leave alpha at zero. The network's own alpha and beta are the all-reduce's.
    """
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
    return Network(name, alpha=alpha, beta=beta, per_op=per_op if len(per_op) > 1 else {},
                   measured=measured, measured_world_size=world_size)


def slowest_rank(per_rank: list[dict]) -> dict:
    """``measure_collectives`` from every rank -> the slowest rank's time per (op, size): a
    collective ends for all when it ends on the last."""
    return {op: [max(col, key=lambda st: st[1]) for col in zip(*(r[op] for r in per_rank))]
            for op in per_rank[0]}


# --------------------------------------------------------------------------- plots
def plot_scaling(profile: Profile, strategies=("overlapped", "zero1", "fsdp"), networks=("100GbE", "nvlink"),
                 world_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256), bucket_cap_mb: float = 25.0):
    """Predicted weak scaling (same per-rank batch at every size) to 256 ranks, one panel per
    network: scaling efficiency = time of one rank / time of N ranks. A matplotlib Figure.

    The ring formulas' latency term grows linearly with N ((N-1) alpha per all-gather): at
    hundreds of ranks NCCL switches to tree algorithms (log N), so for many small collectives
    (FSDP's per-unit all-gathers) the far right of these curves is pessimistic.
    """
    from ddpkit.viz._common import new_figure  # shows in a notebook without pyplot

    fig = new_figure(3.6)
    axes = fig.subplots(1, len(networks), sharey=True, squeeze=False)[0]
    for ax, net in zip(axes, networks):
        net = NETWORKS[net] if isinstance(net, str) else net
        for s in strategies:
            base = simulate(s, profile, 1, net, bucket_cap_mb).ms_per_step
            eff = [100 * base / simulate(s, profile, n, net, bucket_cap_mb).ms_per_step for n in world_sizes]
            ax.plot(world_sizes, eff, marker="o", ms=3, label=s)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(world_sizes), [str(n) for n in world_sizes], fontsize=8)
        ax.minorticks_off()
        ax.set_ylim(0, 105)
        ax.set_title(f"{net.name}: alpha {net.alpha * 1e6:.3g} us, {net.gbytes_per_s:.3g} GB/s", fontsize=10)
        ax.set_xlabel("ranks (GPUs)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("scaling efficiency (%)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Predicted weak scaling, {profile.param_bytes / MiB:.1f} MiB of parameters, "
                 f"{(profile.forward_s + profile.backward_s) * 1e3:.1f} ms compute per step")
    return fig
