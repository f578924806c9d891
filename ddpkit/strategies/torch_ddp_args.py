"""torch's ``DistributedDataParallel`` arguments that are not about how gradients are reduced.

Every ddpkit DDP wrapper takes these keywords with torch's meaning, so it drops into a script:

    device_ids          None (CPU, or a module already on its device) or [the module's one GPU], a
                        list as torch's takes; a forward then moves its tensor inputs there
    output_device       stored (torch only logs it for a single-device module)
    dim                 0 only (torch's multi-device scatter dimension; a single device has none)
    broadcast_buffers   rank 0's buffers at construction and before each forward that follows a
                        synchronising one (BatchNorm's running statistics); torch 2.13's
                        ``forward_sync_buffers`` is the newer name for the per-forward part
    init_sync           False: leave each rank's parameters and buffers as they are at construction
    static_graph        accepted: torch uses it to skip its search for unused parameters and to
                        rebuild its buckets once; here buckets are never rebuilt and a gradient that
                        never arrives is reduced as zeros every step, so nothing changes
    check_reduction     accepted and ignored, as torch ignores it (deprecated there)

Arguments for features ddpkit lacks (``mixed_precision``, ...) are a ValueError naming them;
``TorchDDPArgs.parse`` checks all once, before any rank communicates.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# torch's arguments with no counterpart here, refused unless left at torch's default
UNSUPPORTED = {
    "mixed_precision": None,                 # ddpkit's FSDP has MixedPrecision; DDP: comm hooks (bf16)
    "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None,
    "skip_all_reduce_unused_params": False,
    "bucket_cap_mb_list": None,
    "batched_grad_copy": False,
}


@dataclass(frozen=True)
class TorchDDPArgs:
    """torch DDP's placement and buffer arguments, checked (``parse``)."""

    device: torch.device | None = None   # device_ids[0]: where a forward moves its inputs
    output_device: int | None = None
    dim: int = 0
    init_sync: bool = True                # broadcast rank 0's parameters and buffers at construction
    init_sync_buffers: bool = True        # ... its buffers (torch: broadcast_buffers=False skips them)
    forward_sync_buffers: bool = True     # broadcast rank 0's buffers before a forward
    static_graph: bool = False

    @classmethod
    def parse(cls, strategy: str, module: nn.Module, *, device_ids=None, output_device=None, dim: int = 0,
              broadcast_buffers: bool | None = None, forward_sync_buffers: bool | None = None,
              init_sync: bool = True, static_graph: bool = False, check_reduction: bool = False,
              **others) -> TorchDDPArgs:
        """The arguments as torch reads them; a ValueError naming what cannot be honoured here."""
        for name, value in others.items():
            if name not in UNSUPPORTED:
                raise TypeError(f"{strategy}() got an unexpected keyword argument {name!r}")
            if value is not UNSUPPORTED[name] and value != UNSUPPORTED[name]:
                raise ValueError(f"{strategy}: {name}={value!r} is an argument of torch's DistributedDataParallel "
                                 "that ddpkit's wrappers do not implement; leave it out (docs/own_script.md)")
        if dim != 0:
            raise ValueError(f"{strategy}: dim={dim!r}: only 0 (torch uses it to scatter inputs over several "
                             "GPUs of one process, which neither torch's DDP nor ddpkit does any more)")
        if device_ids is not None and not isinstance(device_ids, (list, tuple)):
            raise TypeError(f"{strategy}: device_ids must be None or a list of one device, as torch's DDP takes "
                            f"it (device_ids=[{device_ids!r}]), got {type(device_ids).__name__} {device_ids!r}")
        devices = {p.device for p in module.parameters()}
        device = None
        if device_ids:  # torch: None or [] for a CPU module or one spread over devices
            if len(device_ids) > 1:
                raise ValueError(f"{strategy}: device_ids can only be None or contain a single element "
                                 f"(one GPU per process), got {list(device_ids)}")
            device = _cuda_device(device_ids[0])
            if devices != {device}:
                where = ", ".join(sorted(str(d) for d in devices))
                raise ValueError(f"{strategy}: device_ids={list(device_ids)} names {device}, but the module's "
                                 f"parameters are on {where}: move the module there first (module.to({device})), "
                                 "or on CPU ranks leave device_ids out, as torch's DDP requires")
        elif output_device is not None:
            raise ValueError(f"{strategy}: output_device={output_device!r} needs device_ids (torch's rule): "
                             "give both for a module on one GPU, neither on the CPU")
        if output_device is None and device is not None:
            output_device = device.index
        if forward_sync_buffers is None:  # torch: broadcast_buffers (default True) sets both
            forward_sync_buffers = init_sync_buffers = True if broadcast_buffers is None else bool(broadcast_buffers)
        else:
            init_sync_buffers = True
        return cls(device, None if output_device is None else _cuda_device(output_device).index, dim,
                   bool(init_sync), init_sync_buffers, bool(forward_sync_buffers), bool(static_graph))


def _cuda_device(device_id) -> torch.device:
    """torch's reading of a device id: an int is a CUDA index; a device or a string is taken as is."""
    device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
    if device.type == "cpu":
        raise ValueError(f"device_ids names {device}: on the CPU leave device_ids out (None), as torch's DDP "
                         "requires; it only takes the one GPU a module sits on")
    if device.index is None:
        device = torch.device(device.type, 0)
    return device


def group_of(strategy: str, process_group, device_mesh):
    """The group to reduce over: ``process_group`` or a 1-D ``device_mesh``'s (torch's two spellings)."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise ValueError(f"{strategy}: give process_group or device_mesh, not both")
    if device_mesh.ndim != 1:
        raise ValueError(f"{strategy}: only a 1-D device_mesh, got {device_mesh.ndim} dimensions "
                         "(for a 2-D mesh of replicas x shards use ddpkit.HSDP)")
    return device_mesh.get_group(mesh_dim=0)
