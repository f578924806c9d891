"""A cost model of data-parallel training: alpha-beta collectives plus a simulated backward pass.

Each collective costs what the ring algorithms cost (PAPERS.md), with alpha the latency of one
message (seconds) and beta the time per byte (seconds per byte, 1 / bandwidth):

    all-reduce of S bytes on N ranks       2(N-1) alpha + 2(N-1)/N S beta
    all-gather / reduce-scatter (full S)    (N-1) alpha +  (N-1)/N S beta

Compute comes from a ``Profile``: per layer, its parameters' bytes and its forward and backward
time (measured in one process with ``profile_model``, or given). Overlap is *simulated*, not
assumed: backward runs the layers in reverse, a gradient is ready when its layer's backward ends,
a bucket's all-reduce is launched when its last gradient is ready, buckets go in order on one
communication stream, and the step ends when both compute and the stream are done. So a bucket
too small pays alpha too often, a bucket too large waits for the whole backward (the U-shaped
curve of the DDP paper), and overlap cannot hide more than the backward compute there is.

``python -m ddpkit predict`` prints these predictions; ``plot_scaling`` draws them up to 256 ranks.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

from ddpkit.experiment import STRATEGIES
from ddpkit.trace import ring_bytes  # bytes one rank sends, by the ring formulas above

MiB = 1024 * 1024


@dataclass(frozen=True)
class Network:
    """A fabric for the alpha-beta model: ``alpha`` seconds per message, ``beta`` seconds per byte."""

    name: str
    alpha: float
    beta: float

    def __post_init__(self):
        if not (self.alpha >= 0 and self.beta >= 0):
            raise ValueError(f"alpha and beta must be >= 0, got {self.alpha}, {self.beta}")

    @property
    def gbytes_per_s(self) -> float:
        return 1e-9 / self.beta if self.beta else math.inf


# Presets. "loopback" was fitted on the development machine (2 CPU cores shared by several
# users, load average ~8; gloo over loopback) with
# `python -m ddpkit predict --fit --fit-ranks 2`: alpha 102 us, 0.44 GB/s. Fit your own machine
# the same way. The others are round figures for the order of magnitude, not measurements:
# 100 GbE moves at most 12.5 GB/s, ~10 GB/s in practice, with tens of microseconds per message
# over TCP; NVLink (A100/H100 class) moves a few hundred GB/s per GPU, a few microseconds per hop.
NETWORKS = {
    "loopback": Network("loopback", alpha=100e-6, beta=1 / 0.45e9),
    "100GbE": Network("100GbE", alpha=20e-6, beta=1 / 10e9),
    "nvlink": Network("nvlink", alpha=5e-6, beta=1 / 200e9),
}


# --------------------------------------------------------------------------- collectives
def collective_time(name: str, nbytes: float, world_size: int, network: Network) -> float:
    """Seconds for one ring collective of full size S: steps x alpha + bytes sent x beta."""
    n = world_size
    if n == 1:
        return 0.0
    steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1,
             "broadcast": n - 1}[name]
    return steps * network.alpha + ring_bytes(name, nbytes, n) * network.beta


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
                              l.unit) for l in self.layers], self.optimizer_s, self.elem_bytes)


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
    ``units`` are the FSDP units (default: ``experiment.fsdp_units``). The optimizer steps, so
    pass a model you do not need afterwards.
    """
    from ddpkit.experiment import fsdp_units, make_optimizer
    from ddpkit.models import loss_fn

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
    totals = {"forward": [], "backward": [], "step": []}
    try:
        for _ in range(repeats + 1):  # the first is a warmup
            t0 = time.perf_counter()
            loss = loss_fn(module(inputs), targets)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            for k, v in zip(totals, (t1 - t0, t2 - t1, t3 - t2)):
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
    return Profile(layers, med["step"])


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


def assign_buckets(param_bytes: list[int], cap_bytes: float, first_cap_bytes: float | None = None) -> list[list[int]]:
    """Indices of ``param_bytes`` (registration order) grouped into buckets, torch DDP's way:
    reverse order, a bucket closes once it reaches the cap (the tensor crossing it stays in),
    cap 0 = one parameter per bucket; ``first_cap_bytes`` caps the first bucket only."""
    if cap_bytes < 0:
        raise ValueError(f"bucket cap must be >= 0, got {cap_bytes}")
    buckets, current, size = [], [], 0
    for i in reversed(range(len(param_bytes))):
        current.append(i)
        size += param_bytes[i]
        cap = first_cap_bytes if (first_cap_bytes is not None and not buckets) else cap_bytes
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


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
    """Forward, backward with bucketed all-reduces (launched from hooks when ``overlap``)."""
    flat, ready = [], []  # every parameter tensor in registration order, and when its grad is ready
    t = profile.forward_s
    layer_ready = {}
    for layer in reversed(profile.layers):  # backward runs the layers in reverse
        t += layer.backward_s
        layer_ready[id(layer)] = t
    for layer in profile.layers:
        for b in layer.param_bytes:
            flat.append(b)
            ready.append(layer_ready[id(layer)])
    end_backward = t
    done = end_backward
    for bucket in assign_buckets(flat, cap_bytes, first_cap_bytes):
        launch = max(ready[i] for i in bucket) if overlap else end_backward
        done = max(done, stream.issue("all_reduce", sum(flat[i] for i in bucket), launch))
    return done


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
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    if isinstance(network, str):
        if network not in NETWORKS:
            raise ValueError(f"unknown network {network!r}; valid: {', '.join(NETWORKS)}")
        network = NETWORKS[network]
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = world_size
    stream = _Stream(n, network)
    cap = bucket_cap_mb * MiB
    opt = profile.optimizer_s
    if strategy == "naive":            # one all-reduce per gradient, after backward
        end = _ddp_step(profile, stream, 0, overlap=False) + opt
    elif strategy == "bucketed":
        end = _ddp_step(profile, stream, cap, overlap=False) + opt
    elif strategy == "overlapped":
        end = _ddp_step(profile, stream, cap, overlap=True) + opt
    elif strategy == "torch_ddp":      # torch caps the first bucket at 1 MiB (default cap only)
        first = 1 * MiB if bucket_cap_mb == 25.0 else None
        end = _ddp_step(profile, stream, cap, overlap=True, first_cap_bytes=first) + opt
    elif strategy == "zero1":
        # Gradients all-reduced as in DDP; each rank steps 1/N of the parameters, then the
        # updated parameters are shared: modelled as one all-gather of all P bytes.
        end = _ddp_step(profile, stream, cap, overlap=True) + opt / n
        end = stream.issue("all_gather", profile.param_bytes, end)
    else:                              # fsdp, torch_fsdp: ZeRO-3 with prefetching
        end = _fsdp_step(profile, stream, reshard=True, prefetch=True) + opt / n
    compute = profile.forward_s + profile.backward_s + (opt / n if strategy in ("zero1", "fsdp", "torch_fsdp") else opt)
    return Prediction(strategy, n, network.name, end * 1e3, compute * 1e3, stream.busy * 1e3,
                      max(0.0, end - compute) * 1e3, stream.bytes, stream.count)


def predict(profile: Profile, strategies=STRATEGIES, world_sizes=(2, 4, 8), network="loopback",
            bucket_cap_mb: float = 25.0) -> list[Prediction]:
    """Every (strategy, world size) pair, world sizes outermost."""
    return [simulate(s, profile, n, network, bucket_cap_mb) for n in world_sizes for s in strategies]


# --------------------------------------------------------------------------- fitting
def measure_all_reduce(sizes=(4 * 1024, 64 * 1024, 1 * MiB, 4 * MiB, 16 * MiB), repeats: int = 15) -> list:
    """A Cluster job: time ``all_reduce`` of each size (bytes, fp32) on this rank; returns
    ``[(bytes, median seconds)]``. Synchronous calls after a barrier, so each is timed alone.

    Every size is run once untimed first: gloo's first collectives on a fresh group pay for
    connection and buffer set-up (a 4 KiB all-reduce measured 3.4 ms cold, 0.2 ms warm).
    """
    import torch
    import torch.distributed as dist

    import ddpkit

    dev = ddpkit.device()
    bufs = [torch.zeros(max(1, size // 4), device=dev) for size in sizes]
    for buf in bufs:  # warm-up, untimed
        dist.all_reduce(buf)
    out = []
    for buf in bufs:
        times = []
        for _ in range(repeats):
            dist.barrier()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out.append((buf.numel() * 4, statistics.median(times)))
    return out


def fit_network(samples, world_size: int, name: str = "fitted") -> Network:
    """Fit alpha and beta to ``[(bytes, seconds)]`` all-reduce timings on N ranks.

    t = 2(N-1) alpha + 2(N-1)/N S beta is a straight line in S. Timings span orders of
    magnitude (microseconds to tens of milliseconds), so the fit minimises *relative* error
    (each sample weighted by 1/t^2); a plain fit would let the largest size decide alone and
    leave alpha at zero. Both are kept >= 0.
    """
    if world_size < 2:
        raise ValueError("fitting needs at least 2 ranks: one rank does not communicate")
    if len(samples) < 2:
        raise ValueError("fitting needs timings at two sizes or more")
    xs = [2 * (world_size - 1) / world_size * s for s, _ in samples]
    ys = [t for _, t in samples]
    ws = [1 / (t * t) if t > 0 else 0.0 for t in ys]
    # weighted least squares for y = c + beta x, with c = 2(N-1) alpha
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx if sxx else 0.0
    beta = max(slope, 0.0)
    alpha = max(my - beta * mx, 0.0) / (2 * (world_size - 1))
    return Network(name, alpha=alpha, beta=beta)


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
