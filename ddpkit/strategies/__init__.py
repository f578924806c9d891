"""The strategies, one file each, in the order the course teaches them.

naive.py       NaiveDDP          all-reduce every gradient after backward
bucketed.py    BucketedDDP       pack gradients into flat buckets, one all-reduce per bucket
overlapped.py  OverlappedDDP     launch each bucket's all-reduce from autograd hooks
zero1.py       ShardedOptimizer  ZeRO-1: each rank keeps and steps 1/N of the optimizer state
fsdp.py        FSDP              ZeRO-3: flat parameters sharded 1/N, gathered just in time
reference.py   torch's own DistributedDataParallel and fully_shard, same interface

What they share: ``_common.py`` (the recorder seam, construction checks), ``ddp_module.py``
(``DDPModule``, the base of the three DDP wrappers),
``buckets.py`` (bucket assignment and the ``Bucket`` object of bucketed and overlapped DDP),
``flat_param.py`` (an FSDP unit's flat parameter, mixed precision, state dicts).
``table.py`` is the table of strategies by name that experiments, the cost model and the
command line read; the strategy files themselves know nothing of it.
"""
from ddpkit.strategies.bucketed import BucketedDDP
from ddpkit.strategies.fsdp import FSDP
from ddpkit.strategies.naive import NaiveDDP
from ddpkit.strategies.overlapped import OverlappedDDP
from ddpkit.strategies.zero1 import ShardedOptimizer

__all__ = ["NaiveDDP", "BucketedDDP", "OverlappedDDP", "ShardedOptimizer", "FSDP"]
