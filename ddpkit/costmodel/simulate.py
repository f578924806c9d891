"""The cost model proper: a profile of one rank's compute, and one training step simulated on it.

Compute comes from a ``Profile``; a collective costs what ``ddpkit.network`` says. Overlap is
simulated, not assumed: backward runs the layers in reverse, a bucket launches when its last
gradient is ready, buckets go in order. So a small bucket pays alpha too often and a large one
waits for the whole backward (the DDP paper's U). Placement on the timeline is ``stream.py``'s.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ddpkit.costmodel.stream import Stream
from ddpkit.network import as_network
from ddpkit.strategies.buckets import assign_buckets, layout  # the same rules the strategies use
from ddpkit.strategies.comm_hooks import COMM_HOOKS, CommHook
from ddpkit.strategies.table import NAMES, TAKES_COMM_HOOK
from ddpkit.strategies.table import unfit
from ddpkit.strategies.table import strategy as strategy_row
from ddpkit.topology import Topology
from ddpkit.units import human_bytes

MiB = 1024 * 1024


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
        return sum(sum(layer.param_bytes) for layer in self.layers)

    @property
    def forward_s(self) -> float:
        return sum(layer.forward_s for layer in self.layers)

    @property
    def backward_s(self) -> float:
        return sum(layer.backward_s for layer in self.layers)

    def copy_s(self, nbytes: float) -> float:
        """Seconds for one pass over ``nbytes`` (a bucket's copy in or out)."""
        return nbytes * self.copy_s_per_byte

    def with_host(self, host_s: float) -> Profile:
        """This profile with ``host_s`` more per step (``wrapper_job``'s) spread over the layers' compute."""
        compute = self.forward_s + self.backward_s
        if host_s <= 0 or compute <= 0:
            return self
        k = 1 + host_s / compute
        return dataclasses.replace(self, layers=[
            dataclasses.replace(layer, forward_s=layer.forward_s * k, backward_s=layer.backward_s * k)
            for layer in self.layers])


def uniform_profile(layers: int, param_bytes: int, forward_ms: float, backward_ms: float | None = None,
                    optimizer_ms: float = 0.0) -> Profile:
    """``layers`` equal layers (one parameter tensor each): the model the tests and examples use."""
    bwd = 2 * forward_ms if backward_ms is None else backward_ms
    return Profile([Layer(f"layer{i}", [param_bytes], forward_ms / 1e3, bwd / 1e3, unit=f"layer{i}")
                    for i in range(layers)], optimizer_ms / 1e3)


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
    phases_ms: dict = dataclasses.field(default_factory=dict)  # {"forward", "backward" (its sync
                                    # included), "step" (the optimizer's, its all-gathers included)}: ms


def _ddp_step(profile: Profile, stream: Stream, cap_bytes: float, overlap: bool,
              first_cap_bytes: float | None = None, reduce: str = "all_reduce", copy_out: bool = True,
              hook: CommHook | None = None) -> float:
    """Forward, backward, the reductions, on the host's timeline beside the stream; when both end.
    ``cap_bytes`` 0: naive; else gradients copied into buckets and out (``copy_out``), during backward
    when ``overlap``; ``hook``: a comm hook's bytes and passes (``COMM_HOOKS``)."""
    flat = [b for layer in profile.layers for b in layer.param_bytes]  # registration order
    t = profile.forward_s
    if cap_bytes == 0:  # naive: in place, one collective per gradient, each awaited
        t += profile.backward_s
        for k, b in enumerate(reversed(flat)):  # after the first, each right after the last's wait: in step
            t = stream.wait(*stream.launch("all_reduce", b, t + profile.copy_s(b), in_step=k > 0))
        return t
    buckets = assign_buckets(flat, cap_bytes, first_cap_bytes=first_cap_bytes)
    sizes = [sum(flat[i] for i in b) for b in buckets]
    hook = hook or COMM_HOOKS["allreduce"]
    before, after = hook.passes
    sent = [hook.wire_bytes(size, profile.elem_bytes) for size in sizes]
    launched = []
    if overlap:
        missing = [len(b) for b in buckets]
        bucket_of = {i: k for k, b in enumerate(buckets) for i in b}
        i = len(flat)
        for layer in reversed(profile.layers):  # backward runs the layers in reverse
            t += layer.backward_s
            for b in reversed(layer.param_bytes):  # its hook copies it in, delaying what follows
                i -= 1
                t += profile.copy_s(b)
                missing[bucket_of[i]] -= 1
                while len(launched) < len(buckets) and missing[len(launched)] == 0:  # in bucket order
                    k = len(launched)
                    t, done = stream.launch(reduce, sent[k], t + profile.copy_s(sizes[k]) * before)
                    launched.append(done)
    else:
        t += profile.backward_s
        for size, wire in zip(sizes, sent, strict=True):  # pack bucket k, launch it, pack k+1 while k is sent
            t, done = stream.launch(reduce, wire, t + profile.copy_s(size) * (1 + before))
            launched.append(done)
    for size, done in zip(sizes, launched, strict=True):  # wait for each in order, copy it back out
        t = stream.wait(t, done) + profile.copy_s(size) * (copy_out + after)
    return t


def _fsdp_step(profile: Profile, stream: Stream, shards: Topology, reshard: bool = True,
               forward_prefetch: bool = False, backward_prefetch: bool = True,
               limit: int | None = None) -> tuple[float, float]:
    """ZeRO-3 on one stream: all-gathers before forward (and backward, ``reshard``), a reduce-scatter
    after each backward, prefetches while under ``limit``; hybrid (k < N): shards all-reduced across
    nodes. Returns (forward's end, backward's communication's end)."""
    k = shards.ranks_per_node
    node = shards.node_ranks(0)        # rank 0's shard group: its node's ranks (all of them for fsdp)
    replicas = shards.peer_ranks(0)    # hybrid sharding: rank 0 and its replicas, one per node
    units: dict[str, list[Layer]] = {}
    for layer in profile.layers:
        units.setdefault(layer.unit, []).append(layer)
    names = [u for u in units if u != ""]
    pad = k * profile.elem_bytes
    size = {u: math.ceil(sum(sum(layer.param_bytes) for layer in ls) / pad) * pad for u, ls in units.items()}
    fwd = {u: sum(layer.forward_s for layer in ls) for u, ls in units.items()}
    bwd = {u: sum(layer.backward_s for layer in ls) for u, ls in units.items()}

    def may_prefetch(held: int) -> bool:
        return limit is None or held < limit

    t = 0.0
    if "" in units:  # the root's own parameters: gathered once, kept until its backward
        t = stream.wait(*stream.launch("all_gather", size[""], 0.0, node))
    order = names
    gathered: dict = {}
    for i, u in enumerate(order):
        if u not in gathered:
            t, gathered[u] = stream.launch("all_gather", size[u], t, node)
        start = stream.wait(t, gathered[u])
        held = 1 if reshard else i + 1  # units unsharded now, the root not counted
        if forward_prefetch and i + 1 < len(order) and may_prefetch(held):
            nxt = order[i + 1]
            start, gathered[nxt] = stream.launch("all_gather", size[nxt], start, node)
        t = start + fwd[u]
    t += fwd.get("", 0.0)  # root-level compute (embeddings, head) in forward
    forward_end = t
    t += bwd.get("", 0.0)  # ... and its backward, first
    back = list(reversed(order))
    regathered: dict = {}
    reduced = []
    for i, u in enumerate(back):
        if reshard and u not in regathered:
            t, regathered[u] = stream.launch("all_gather", size[u], t, node)
        start = stream.wait(t, regathered[u]) if u in regathered else t
        if reshard and backward_prefetch and i + 1 < len(back) and may_prefetch(1):
            nxt = back[i + 1]
            start, regathered[nxt] = stream.launch("all_gather", size[nxt], start, node)
        t = start + bwd[u]
        t, done = stream.launch("reduce_scatter", size[u], t, node)
        reduced.append((u, done))
    if "" in units:
        t, done = stream.launch("reduce_scatter", size[""], t, node)
        reduced.append(("", done))
    if shards.nodes > 1:  # hybrid: each gradient shard (size / k) all-reduced across the n / k replicas
        for u, done in reduced:
            t = stream.wait(t, done)
            t, _ = stream.launch("all_reduce", size[u] / k, t, replicas)
    return forward_end, stream.finish(t)


def simulate(strategy: str, profile: Profile, world_size: int, network="loopback",
             bucket_cap_mb: float | None = None, cost=None) -> Prediction:
    """Predict one step of ``strategy`` at ``world_size`` ranks on ``network`` (``as_network``);
    ``cost``: a ``CostStep`` instead of the table's (e.g. ``replace(..., forward_prefetch=True)``)."""
    step = strategy_row(strategy).cost if cost is None else cost  # how the strategy communicates
    if step.comm_hook is not None and not strategy_row(strategy).takes_comm_hook:
        raise ValueError(f"{strategy} takes no communication hook (its buckets are not all-reduced by "
                         f"our wrapper); those that do: {', '.join(TAKES_COMM_HOOK)}")
    network = as_network(network)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = world_size
    # a comm hook chains its work on its collective's future (comm_hooks.py), as torch's DDP does
    stream = Stream(n, network, on_futures=step.on_futures or step.comm_hook is not None,
                    copy_s_per_byte=profile.copy_s_per_byte)
    # the ranks it shards over: all N, or for hybrid sharding the k of a node (the network's
    # nodes, else the default layout); a ValueError where they do not come in whole nodes
    k = strategy_row(strategy).shard_group_size(n, network)
    opt = profile.optimizer_s / k if step.sharded_optimizer else profile.optimizer_s  # it steps 1/k
    if step.algorithm != "ddp":  # ZeRO-3: flat parameters sharded k ways
        forward_end, synced = _fsdp_step(profile, stream, Topology(n, k), reshard=step.reshard,
                                         forward_prefetch=step.forward_prefetch,
                                         backward_prefetch=step.backward_prefetch, limit=step.limit_all_gathers)
        end = synced + opt
    else:
        # the wrappers' bucket layout (torch DDP's rule: a cap left at None is 25 MiB, the first 1 MiB)
        cap_mb, first_mb = layout(bucket_cap_mb)
        cap = cap_mb * MiB if step.bucketed else 0  # cap 0: naive, one all-reduce per gradient
        first = first_mb * MiB if step.bucketed and first_mb is not None else None
        forward_end = profile.forward_s
        synced = _ddp_step(profile, stream, cap, overlap=step.overlap, first_cap_bytes=first,
                           reduce=step.grad_reduce, copy_out=step.copy_out,
                           hook=COMM_HOOKS[step.comm_hook] if step.comm_hook else None)
        end = synced + opt
        p_bytes = profile.param_bytes
        flat = [b for layer in profile.layers for b in layer.param_bytes]
        if step.gather_params and (step.gather_in_place or step.gather_by_broadcast):
            # in place, no copies, all launched then all waited for: ZeRO-1/2 all-gather each
            # bucket's flat parameters; torch's ZeroRedundancyOptimizer broadcasts every parameter
            # from the rank that stepped it
            if step.gather_in_place:
                op, sizes = "all_gather", [sum(flat[i] for i in b)
                                           for b in assign_buckets(flat, cap or 1, first_cap_bytes=first)]
            else:
                op, sizes = "broadcast", flat
            done = []
            for size in sizes:
                end, finished = stream.launch(op, size, end)
                done.append(finished)
            for finished in done:
                end = stream.wait(end, finished)
        elif step.gather_params:
            # one all-gather of all P bytes: our stepped 1/N copied in, the gathered ones back out
            end = stream.wait(*stream.launch("all_gather", p_bytes, end + profile.copy_s(p_bytes / n)))
            end += profile.copy_s(p_bytes)
    compute = profile.forward_s + profile.backward_s + opt
    phases = {"forward": forward_end, "backward": synced - forward_end, "step": end - synced}
    return Prediction(strategy, n, network.name, end * 1e3, compute * 1e3, stream.busy * 1e3,
                      max(0.0, end - compute) * 1e3, stream.bytes, stream.count,
                      {k: v * 1e3 for k, v in phases.items()})


def predict(profile: Profile, strategies=NAMES, world_sizes=(2, 4, 8), network="loopback",
            bucket_cap_mb: float | None = None, comm_hook: str | None = None) -> list[Prediction]:
    """Every (strategy, world size) pair, world sizes outermost; a ValueError naming a strategy that
    cannot run at a world size (``table.unfit``). ``comm_hook``: for the strategies that take one."""
    network = as_network(network)
    why = unfit(strategies, world_sizes, network)
    if why:
        raise ValueError("; ".join(why.values()))
    rows = {s: strategy_row(s) for s in strategies}
    costs = {s: dataclasses.replace(row.cost, comm_hook=comm_hook if row.takes_comm_hook else None)
             for s, row in rows.items()}
    return [simulate(s, profile, n, network, bucket_cap_mb, cost=costs[s]) for n in world_sizes for s in strategies]


def format_predictions(predictions: list[Prediction]) -> str:
    """``python -m ddpkit predict``'s table: one line per prediction (bytes: sent by one rank)."""
    w = max([8] + [len(p.strategy) for p in predictions])  # the longest name ("sharded_optimizer") fits
    lines = [f"{'ranks':>5}  {'strategy':>{w}}  {'ms/step':>9}  {'compute':>8}  {'exposed communication':>21}  "
             f"{'sent/step':>12}"]
    for p in predictions:
        lines.append(f"{p.world_size:>5}  {p.strategy:>{w}}  {p.ms_per_step:9.2f}  {p.compute_ms:8.2f}  "
                     f"{p.exposed_comm_ms:21.2f}  {human_bytes(p.comm_bytes_per_step):>12}")
    return "\n".join(lines)
