"""torch's own implementations behind ddpkit's small interface, for side-by-side comparison.

    TorchDDP(module, bucket_cap_mb=None)   torch.nn.parallel.DistributedDataParallel
    TorchFSDP(module, units=None)          torch.distributed.fsdp.fully_shard (FSDP2)
    TorchHSDP(module, gpus_per_node, units=None)   fully_shard on a 2-D (replicate, shard) DeviceMesh

(torch's ZeroRedundancyOptimizer is built over TorchDDP by the table.) Each has ddpkit's interface
(``finish_gradient_synchronization()`` a no-op: torch finishes in ``backward()``); torch's
collectives are recorded all the same, by ddpkit's process group, which carries them.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.strategies.common import (clip_grad_norm_, default_units, nbytes, prepare_module,
                                      require_process_group, resolve_units, unique_named_parameters)
from ddpkit.strategies.ddp_module import DDPModule
from ddpkit.strategies.buckets import bucket_cap_bytes
from ddpkit.torch_internals import fully_shard
from ddpkit.trace.seam import recorder as rank_recorder


class TorchDDP(nn.Module):
    """torch.nn.parallel.DistributedDataParallel with ddpkit's interface."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None, process_group=None,
                 recorder=None, **ddp_kwargs):
        super().__init__()
        require_process_group("TorchDDP", process_group)
        if bucket_cap_mb is not None:
            bucket_cap_bytes(bucket_cap_mb)  # the same checks as ours (negative, NaN, not a number)
        self.recorder = rank_recorder() if recorder is None else recorder  # None: the rank's
        self.process_group = process_group
        # DDP broadcasts rank 0's state at construction, as ours do; a cap left at None is torch's
        # default (the first bucket 1 MiB), a cap given applies to every bucket: ours' rule too
        self.ddp = nn.parallel.DistributedDataParallel(module, process_group=process_group,
                                                       bucket_cap_mb=bucket_cap_mb, **ddp_kwargs)
        if self.recorder.enabled:
            self._look_inside()

    def _look_inside(self) -> None:
        """Recording: gradient hooks mark readiness; a comm hook doing the default's work labels each
        collective with torch's bucket, so the fill plot shows torch's own buckets."""
        rec, group = self.recorder, self.process_group
        names = {}
        for name, p in unique_named_parameters(self.module):
            names[id(p)] = name
            p.register_post_accumulate_grad_hook(lambda _p, name=name: rec.grad_ready(name, bucket=None))
        world = dist.get_world_size(group)

        def labelled_all_reduce(_state, bucket):
            flat = bucket.buffer().div_(world)
            with rec.labels(bucket=bucket.index(), params=[names[id(p)] for p in bucket.parameters()]):
                work = dist.all_reduce(flat, group=group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])

        self.ddp.register_comm_hook(None, labelled_all_reduce)

    @property
    def module(self) -> nn.Module:
        return self.ddp.module

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self.recorder.begin_forward()  # as ours: a training forward begins a step, unless the loop began it
        return self.ddp(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Nothing to do: torch DDP's reducer has averaged every gradient when backward returns."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch's own clipping: every rank holds the whole averaged gradient."""
        return clip_grad_norm_(self.module.parameters(), max_norm, norm_type)

    def no_sync(self):
        return self.ddp.no_sync()

    full_state_dict = DDPModule.full_state_dict  # every rank holds the whole model, as in ours

    def comm_buffer_bytes(self) -> int:
        """About DDP's bucket bytes: every trainable parameter once (torch does not expose the figure)."""
        return sum(nbytes(p) for _, p in unique_named_parameters(self.module))


class TorchFSDP(nn.Module):
    """torch's FSDP2 (``fully_shard``) on each unit, then on the root, with ddpkit's interface."""

    def __init__(self, module: nn.Module, units: Iterable[nn.Module | type] | None = None,
                 reshard_after_forward: bool = True, process_group=None, recorder=None, mesh=None):
        super().__init__()
        # fully_shard shards whatever each rank holds: make ranks start equal first (as ours do)
        prepare_module(type(self).__name__, module, process_group)
        from torch.distributed.device_mesh import DeviceMesh

        self.recorder = rank_recorder() if recorder is None else recorder  # None: the rank's
        self.process_group = process_group
        device = next(module.parameters()).device
        if mesh is None:  # a 1-D mesh over the ranks of the group (on CPU: a "cpu" mesh, gloo underneath)
            mesh = DeviceMesh.from_group(process_group or dist.group.WORLD, device.type)
        # the same units as ours: modules or classes given, else the blocks of the largest ModuleList
        units = default_units(module) if units is None else resolve_units(module, units)
        for unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
        self.module = fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self.recorder.begin_forward()  # as ours: a training forward begins a step, unless the loop began it
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Nothing to do: fully_shard waits for its reduce-scatters at the end of backward."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` on the DTensor gradients; the total norm as a plain tensor."""
        total = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm, norm_type)
        return total.full_tensor() if hasattr(total, "full_tensor") else total

    @contextlib.contextmanager
    def no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """{name: full tensor} on every rank (each DTensor shard all-gathered)."""
        return {name: p.full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
                for name, p in self.module.named_parameters()}

    def comm_buffer_bytes(self) -> int:
        """0: fully_shard allocates and frees its all-gather buffers internally, out of view."""
        return 0


class TorchHSDP(TorchFSDP):
    """torch's hybrid sharding: ``fully_shard`` on a (replicate, shard) DeviceMesh of ``hybrid_layout``'s groups."""

    def __init__(self, module: nn.Module, gpus_per_node: int, units: Iterable[nn.Module] | None = None,
                 reshard_after_forward: bool = True, process_group=None, recorder=None):
        if process_group is not None:
            raise ValueError("TorchHSDP lays out every rank of the default process group; it takes no process_group")
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        from ddpkit.strategies.hsdp import hybrid_groups, hybrid_layout

        require_process_group("TorchHSDP")
        shard_ranks, _ = hybrid_layout(dist.get_world_size(), gpus_per_node)  # ValueError first
        shard_group, replicate_group = hybrid_groups(gpus_per_node)
        device = next(module.parameters()).device
        layout = torch.tensor(shard_ranks)  # (nodes, gpus_per_node): row = node, column = local rank
        if replicate_group is None:  # a single node: nothing to replicate, a 1-D mesh (FSDP)
            mesh = DeviceMesh.from_group(shard_group, device.type)
        else:
            mesh = DeviceMesh.from_group([replicate_group, shard_group], device.type, mesh=layout,
                                         mesh_dim_names=("replicate", "shard"))
        super().__init__(module, units, reshard_after_forward, recorder=recorder, mesh=mesh)
        self.gpus_per_node = gpus_per_node
