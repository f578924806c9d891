"""The table of strategies: one entry per name, read by everything that runs or reasons about them.

    strategy(name).wrap(module, bucket_cap_mb=1.0)    # the wrapped model
    strategy(name).zero_stage                         # e.g. "ZeRO-2": its memory formula
    strategy(name).cost                               # its step, for the cost model
    strategy(name).shard_group_size(4, topology)      # ranks its state is sharded over

The strategy files know nothing of it; its consumers (experiment, costmodel, memory, viz, the
command line, the tests) read it. Adding a strategy is its file plus one row; this is the one
module that spells the strategies' names.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from ddpkit.models import MLP, TinyGPT
from ddpkit.strategies.common import default_units, resolve_units
from ddpkit.topology import Topology


@dataclass(frozen=True)
class CostStep:
    """How the cost model simulates one step, as plain data (``costmodel.simulate`` reads it)."""

    algorithm: str                    # "ddp" | "fsdp"
    bucketed: bool = True
    grad_reduce: str = "all_reduce"   # "all_reduce" | "reduce_scatter" (ZeRO-1/2)
    overlap: bool = False
    gather_params: bool = False
    gather_in_place: bool = False     # per bucket, into the parameters (ZeRO-1/2); else one buffer,
                                      # our 1/N copied in and the rest copied out (ShardedOptimizer)
    gather_by_broadcast: bool = False # each parameter broadcast from the rank that stepped it, all
                                      # launched at once (torch's ZeroRedundancyOptimizer): an
                                      # all-gather's bytes, one collective per parameter
    copy_out: bool = True             # the reduced bucket copied back into .grad (ZeRO-1/2: not)
    sharded_optimizer: bool = False   # the optimizer steps 1/N of the parameters
    reshard: bool = True
    forward_prefetch: bool = False    # our FSDP's defaults, as torch's: backward prefetch only
    backward_prefetch: bool = True
    limit_all_gathers: int | None = None
    comm_hook: str | None = None      # the buckets' all-reduce replaced by this communication hook
                                      # (a name in comm_hooks.COMM_HOOKS): its bytes and passes
    on_futures: bool = False          # the wrapper chains its work on each collective's future
                                      # (torch's DDP): under at_wait the bytes move on the
                                      # link's thread when the link delivers (comm.emulator)


@dataclass(frozen=True)
class Strategy:
    """One row: a name, what it is, how to build it, and what the consumers need to know of it."""

    name: str
    summary: str                      # one line, for tables and --help
    wrap: Callable                    # (module, *, bucket_cap_mb, recorder, process_group) -> model
                                      # (the FSDP rows also take units=: modules or classes)
    optimizer: Callable               # (model, cls, defaults, *, recorder, process_group) -> optimizer
    zero_stage: str                   # "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3": the memory formula it follows
    cost: CostStep
    bytes_vs_ddp: float | None = 1.0  # bytes sent per step in theory, relative to DDP's all-reduce
                                      # (None: it depends on the layout, e.g. hybrid sharding's nodes)
    torch_native: bool = False        # torch's own implementation, for side-by-side comparison
    family: str = "ddp"               # which torch wrapper it is compared with: "ddp", "zero",
                                      # "fsdp" or "hsdp"
    predictable: bool = True          # the cost model covers all it does (torch_fsdp's host-side
                                      # overheads per unit it does not)
    hybrid: bool = False              # sharded inside each node of the rank layout, replicated
                                      # across nodes (a ddpkit.Topology says which ranks those are)
    headline: bool = False            # one of the rungs plots show unless told: the best DDP,
                                      # ZeRO-1 and ZeRO-3
    takes_comm_hook: bool = False     # our wrapper all-reduces its buckets, so a communication hook
                                      # can replace that (comm_hook=, strategies/comm_hooks.py)

    def shard_group_size(self, world_size: int, topology=None) -> int:
        """Over how many of ``world_size`` ranks its state is sharded: all, or for hybrid sharding a node
        of ``topology`` (a Topology, a Network, None: the default); ValueError without whole nodes."""
        if not self.hybrid:
            return world_size
        return Topology.of(topology, world_size).ranks_per_node

    def fits(self, world_size: int, topology=None) -> bool:
        """Whether it can run on ``world_size`` ranks laid out by ``topology`` (as above)."""
        return not unfit([self.name], [world_size], topology)


# ----------------------------------------------------------------------------- how to build
def fsdp_units(module, units=None) -> list:
    """The FSDP units: ``units`` as given, a Linear of the MLP or a block of TinyGPT each, else the default."""
    if units is not None:
        return resolve_units(module, units)
    if isinstance(module, MLP):
        return [block[0] for block in module.layers] + [module.head]
    if isinstance(module, TinyGPT):
        return list(module.blocks)
    return default_units(module)


def _node_size() -> int:
    """The ranks per node hybrid sharding shards over: this rank's ``rankside.topology()``."""
    from ddpkit.rankside import topology

    return topology().ranks_per_node


def _build(home: str, cls: str, cap: bool = True, units: bool = False, hybrid: bool = False) -> Callable:
    """How a row wraps: ``ddpkit.strategies.<home>.<cls>``, imported when first built, given what it takes."""
    def wrap(module, bucket_cap_mb, **options):
        wrapper = getattr(importlib.import_module(f"ddpkit.strategies.{home}"), cls)
        if cap:
            options["bucket_cap_mb"] = bucket_cap_mb
        if units:
            options["units"] = fsdp_units(module, options.get("units"))
        if hybrid:
            options["gpus_per_node"] = _node_size()
        return wrapper(module, **options)

    return wrap


def _local_optimizer(model, cls, defaults, recorder=None, process_group=None):
    """A plain torch optimizer over what the wrapper exposes (FSDP: the local shards)."""
    return cls(model.parameters(), **defaults)


def _sharded_optimizer(model, cls, defaults, recorder=None, process_group=None):
    """ShardedOptimizer: ``cls`` over this rank's 1/N of the (whole) parameters."""
    from ddpkit.strategies.sharded_optimizer import ShardedOptimizer

    return ShardedOptimizer(model.parameters(), cls, recorder=recorder, process_group=process_group,
                            **defaults)


def _zero_optimizer(model, cls, defaults, recorder=None, process_group=None):
    """ZeRO-1/2: ``cls`` over this rank's shards of the flat buckets (the wrapper builds it)."""
    return model.make_optimizer(cls, **defaults)


def _torch_zero_optimizer(model, cls, defaults, recorder=None, process_group=None):
    """torch's ZeroRedundancyOptimizer: ``cls`` over this rank's 1/N of the parameters."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, process_group=process_group,
                                   **defaults)


# ----------------------------------------------------------------------------- the table
_ROWS = [
    Strategy("naive", "all-reduce every gradient after backward", _build("naive", "NaiveDDP", cap=False),
             _local_optimizer, "DDP", CostStep("ddp", bucketed=False)),
    Strategy("bucketed", "flat buckets, all-reduced after backward", _build("bucketed", "BucketedDDP"),
             _local_optimizer, "DDP", CostStep("ddp"), takes_comm_hook=True),
    Strategy("overlapped", "buckets all-reduced from gradient hooks, during backward",
             _build("overlapped", "OverlappedDDP"), _local_optimizer, "DDP", CostStep("ddp", overlap=True),
             headline=True, takes_comm_hook=True),
    Strategy("sharded_optimizer", "overlapped DDP + optimizer state sharded 1/N, parameters all-gathered",
             _build("overlapped", "OverlappedDDP"), _sharded_optimizer, "ZeRO-1",
             CostStep("ddp", overlap=True, gather_params=True, sharded_optimizer=True), bytes_vs_ddp=1.5,
             family="zero", takes_comm_hook=True),
    Strategy("zero1", "ZeRO-1: gradients reduce-scattered after backward, 1/N stepped, parameters all-gathered",
             _build("zero1", "ZeRO1"), _zero_optimizer, "ZeRO-1",
             CostStep("ddp", grad_reduce="reduce_scatter", gather_params=True, gather_in_place=True,
                      copy_out=False, sharded_optimizer=True), family="zero", headline=True),
    Strategy("zero2", "ZeRO-2: gradients reduce-scattered in buckets during backward and freed",
             _build("zero2", "ZeRO2"), _zero_optimizer, "ZeRO-2",
             CostStep("ddp", overlap=True, grad_reduce="reduce_scatter", gather_params=True,
                      gather_in_place=True, copy_out=False, sharded_optimizer=True), family="zero"),
    Strategy("fsdp", "ZeRO-3: flat parameters sharded 1/N, gathered just in time",
             _build("fsdp", "FSDP", cap=False, units=True), _local_optimizer, "ZeRO-3",
             CostStep("fsdp", sharded_optimizer=True), bytes_vs_ddp=1.5, family="fsdp", headline=True),
    Strategy("hsdp", "hybrid: FULL_SHARD inside a node, gradient shards all-reduced across nodes",
             _build("hsdp", "HSDP", cap=False, units=True, hybrid=True), _local_optimizer, "ZeRO-3",
             CostStep("fsdp", sharded_optimizer=True), bytes_vs_ddp=None, family="hsdp", hybrid=True),
    Strategy("torch_ddp", "torch's DistributedDataParallel", _build("reference", "TorchDDP"), _local_optimizer,
             "DDP", CostStep("ddp", overlap=True, on_futures=True), torch_native=True),
    Strategy("torch_zero", "torch's ZeroRedundancyOptimizer over its DistributedDataParallel",
             _build("reference", "TorchDDP"), _torch_zero_optimizer, "ZeRO-1",
             CostStep("ddp", overlap=True, gather_params=True, gather_by_broadcast=True, sharded_optimizer=True,
                      on_futures=True),
             bytes_vs_ddp=1.5, torch_native=True, family="zero", predictable=False),
    Strategy("torch_fsdp", "torch's fully_shard (FSDP2)", _build("reference", "TorchFSDP", cap=False, units=True),
             _local_optimizer, "ZeRO-3", CostStep("fsdp", sharded_optimizer=True, forward_prefetch=True),
             bytes_vs_ddp=1.5, torch_native=True, family="fsdp", predictable=False),
    Strategy("torch_hsdp", "torch's fully_shard on a 2-D (replicate, shard) DeviceMesh",
             _build("reference", "TorchHSDP", cap=False, units=True, hybrid=True), _local_optimizer, "ZeRO-3",
             CostStep("fsdp", sharded_optimizer=True, forward_prefetch=True), bytes_vs_ddp=None, torch_native=True,
             family="hsdp", predictable=False, hybrid=True),
]
STRATEGIES: dict[str, Strategy] = {row.name: row for row in _ROWS}
NAMES: tuple[str, ...] = tuple(STRATEGIES)
HEADLINE: tuple[str, ...] = tuple(row.name for row in _ROWS if row.headline)  # DDP, ZeRO-1, ZeRO-3
TAKES_COMM_HOOK: tuple[str, ...] = tuple(row.name for row in _ROWS if row.takes_comm_hook)
DEFAULT = "overlapped"  # what a run trains with unless told (python -m ddpkit.train)


def strategy(name: str) -> Strategy:
    """The table's row for ``name``; a ValueError listing the valid names otherwise."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(NAMES)}")
    return STRATEGIES[name]


def unfit(names, world_sizes, topology=None) -> dict[str, str]:
    """``{name: why}`` for ``names`` that cannot run at one of ``world_sizes`` on ``topology``."""
    why = {}
    for name in names:
        for n in world_sizes:
            try:
                strategy(name).shard_group_size(n, topology)
            except ValueError as exc:
                why.setdefault(name, f"{name} shards inside nodes: {exc}")
    return why
