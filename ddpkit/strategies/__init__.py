"""The strategies, one file each, in the order the course teaches them.

naive.py              NaiveDDP          all-reduce every gradient after backward
bucketed.py           BucketedDDP       pack gradients into flat buckets, one all-reduce per bucket
overlapped.py         OverlappedDDP     launch each bucket's all-reduce from autograd hooks
sharded_optimizer.py  ShardedOptimizer  each rank keeps and steps 1/N of the optimizer state, over
                                        any DDP wrapper (torch's ZeroRedundancyOptimizer design: 1.5x bytes)
zero1.py              ZeRO1             ZeRO stage 1: reduce-scatter gradients, step 1/N, all-gather parameters
zero2.py              ZeRO2             stage 2: reduce-scatter in buckets during backward, free full gradients
fsdp.py               FSDP              ZeRO-3: flat parameters sharded 1/N, gathered just in time
                                        (forward/backward prefetch, rate limiter, deferred init)
hsdp.py               HSDP              hybrid sharding: FSDP inside a node, replicated across nodes
reference.py          torch's own DistributedDataParallel, ZeroRedundancyOptimizer and fully_shard
                      (1-D, and 2-D for hybrid sharding)

What they share: ``ddp_module.py`` (``DDPModule``, the core of the DDP wrappers: construction,
forward, the sync flag, the gradient hooks, the sync at the end of backward), ``ddp_compat.py``
(``TorchDDPCompat``: torch DDP's arguments, buffers, unused parameters, comm hooks and Join,
composed onto the core), ``buckets.py`` (bucket assignment and the ``Bucket`` object of bucketed
and overlapped DDP), ``common.py`` (construction checks, FSDP's units, clipping, timing),
``zero_buckets.py`` (ZeRO-1/2's buckets padded to N shards, and which optimizers can be sharded),
``flat_layout.py`` (``FlatLayout``: where each tensor sits in a flat buffer, padding to a multiple
of N, a rank's shard; every flat buffer above follows it),
``flat_param.py`` (FSDP's plan of units and a unit's flat parameter, mixed precision),
``deferred_init.py`` (FSDP's unit-by-unit materialization of a model built on the meta device),
``comm_hooks.py`` (how a DDP bucket is reduced: all-reduce, fp16 or bf16 compression).
``table.py`` is the table of strategies by name that experiments, the cost model and the
command line read; the strategy files themselves know nothing of it.

The names below are imported on first use: importing one strategy loads only what it needs.
"""
from ddpkit import lazy_names

_HOMES = {"NaiveDDP": ".naive", "BucketedDDP": ".bucketed", "OverlappedDDP": ".overlapped",
          "ShardedOptimizer": ".sharded_optimizer", "ZeRO1": ".zero1", "ZeRO2": ".zero2", "FSDP": ".fsdp",
          "HSDP": ".hsdp"}
__all__ = list(_HOMES)
__getattr__, __dir__ = lazy_names(globals(), _HOMES)
