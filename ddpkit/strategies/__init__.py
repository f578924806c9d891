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

Shared: ``ddp_module.py`` (the DDP core), ``ddp_compat.py`` (torch DDP's extras), ``buckets.py``,
``common.py``, ``zero_buckets.py``, ``flat_layout.py``, ``flat_param.py``, ``deferred_init.py``,
``comm_hooks.py``; ``table.py`` is the table by name its consumers read.

The names below are imported on first use: importing one strategy loads only what it needs.
"""
from ddpkit.lazy import lazy_names

_HOMES = {"NaiveDDP": ".naive", "BucketedDDP": ".bucketed", "OverlappedDDP": ".overlapped",
          "ShardedOptimizer": ".sharded_optimizer", "ZeRO1": ".zero1", "ZeRO2": ".zero2", "FSDP": ".fsdp",
          "HSDP": ".hsdp"}
__all__ = list(_HOMES)
__getattr__, __dir__ = lazy_names(globals(), _HOMES)
