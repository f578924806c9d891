"""The reference answers: what the course's formulas say for a question's setting, to the byte.

The ring formulas (``ddpkit.network.ring_bytes``) and the ZeRO formulas (``ddpkit.memory``) count
Ψ parameters; a run moves and keeps flat buffers, each padded to a multiple of the ranks it is
sharded over (``FlatLayout``: at most N-1 elements each), laid out by the kit's own rules (DDP's
buckets, FSDP's units). So each reference here is the formula over those buffers: the formula
itself where nothing needs padding, and exact where something does. Nothing here runs a model:
it is built on the meta device (shapes only).
"""
from __future__ import annotations

from ddpkit.network import LINKS, Link, collective_time, ring_bytes
from ddpkit.strategies.buckets import assign_buckets, layout
from ddpkit.strategies.flat_layout import FlatLayout

MiB = 2**20


def meta_model(model_kwargs: dict | None = None, module=None):
    """The course's MLP (sized by ``model_kwargs``) on the meta device, or ``module`` as given."""
    if module is not None:
        return module
    import torch

    from ddpkit.models import build_model

    with torch.device("meta"):
        return build_model("mlp", **(model_kwargs or {}))


def param_sizes(module) -> list[int]:
    """Bytes of each trainable parameter tensor, registration order, a tied one once."""
    seen, out = set(), []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p.numel() * p.element_size())
    return out


def bucket_elements(module, bucket_cap_mb: float | None) -> list[int]:
    """Elements per DDP (or ZeRO-1/2) bucket, by the wrappers' rule (``buckets.assign_buckets``)."""
    sizes = param_sizes(module)
    cap_mb, first_mb = layout(bucket_cap_mb)
    first = None if first_mb is None else int(first_mb * MiB)
    buckets = assign_buckets(sizes, int(cap_mb * MiB), first_cap_bytes=first)
    numels = [p.numel() for p in module.parameters() if p.requires_grad]
    return [sum(numels[i] for i in b) for b in buckets]


def unit_elements(module) -> list[int]:
    """Elements per FSDP flat parameter: one per unit (``fsdp_units``), then the root's rest."""
    from ddpkit.strategies.table import fsdp_units

    seen, out = set(), []
    for unit in fsdp_units(module):
        params = [p for p in unit.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        out.append(sum(p.numel() for p in params))
    rest = sum(p.numel() for p in module.parameters() if p.requires_grad and id(p) not in seen)
    return out + ([rest] if rest else [])


def shard_elements(elements: list[int], world_size: int) -> int:
    """Elements one rank keeps of flat buffers of ``elements`` each, sharded N ways: ceil(T/N) each."""
    return sum(FlatLayout([(t,)], world_size).shard_numel for t in elements)


def padded_elements(elements: list[int], world_size: int) -> int:
    return sum(FlatLayout([(t,)], world_size).padded_numel for t in elements)


# --------------------------------------------------------------------------- bytes sent per step
def ddp_bytes(world_size: int, model_kwargs: dict | None = None) -> float:
    """DDP (naive, bucketed, overlapped): all-reduce every gradient, 2(N-1)/N x S (fp32)."""
    return ring_bytes("all_reduce", sum(param_sizes(meta_model(model_kwargs))), world_size)


def zero1_bytes(world_size: int, model_kwargs: dict | None = None, bucket_cap_mb: float | None = None) -> float:
    """ZeRO-1/2: reduce-scatter each padded bucket, all-gather it back: 2 x (N-1)/N x S."""
    s = 4 * padded_elements(bucket_elements(meta_model(model_kwargs), bucket_cap_mb), world_size)
    return ring_bytes("reduce_scatter", s, world_size) + ring_bytes("all_gather", s, world_size)


def fsdp_bytes(world_size: int, model_kwargs: dict | None = None, module=None) -> float:
    """FSDP (reshard after forward): per unit, all-gather twice and reduce-scatter once its padded
    flat parameter: 3 x (N-1)/N x S."""
    s = 4 * padded_elements(unit_elements(meta_model(model_kwargs, module)), world_size)
    return 2 * ring_bytes("all_gather", s, world_size) + ring_bytes("reduce_scatter", s, world_size)


def hsdp_inter_node_bytes(world_size: int, ranks_per_node: int, model_kwargs: dict | None = None) -> float:
    """Hybrid sharding: per unit, the shard (padded over a node's k ranks, 1/k of it) all-reduced
    among the W = N/k nodes: 2(W-1)/W x M/k, the FSDP paper's 2M(W-1)/(GW)."""
    k, w = ranks_per_node, world_size // ranks_per_node
    shard = 4 * shard_elements(unit_elements(meta_model(model_kwargs)), k)
    return ring_bytes("all_reduce", shard, w)


# --------------------------------------------------------------------------- memory per rank
def zero1_optimizer_state(world_size: int, model_kwargs: dict | None = None, state_bytes: int = 8,
                          bucket_cap_mb: float | None = None) -> int:
    """ZeRO-1 with AdamW (two fp32 moments, 8 bytes per element): K x (rank 0's shard of each
    padded bucket), the ZeRO paper's K Ψ / N."""
    return state_bytes * shard_elements(bucket_elements(meta_model(model_kwargs), bucket_cap_mb), world_size)


def fsdp_model_state(world_size: int, module, bytes_per_element: int = 12) -> int:
    """FSDP: parameters, gradients and optimizer state of this rank's shard of every unit
    (SGD with momentum in fp32: 4 + 4 + 4 bytes per element), the ZeRO paper's 16Ψ/N with K = 4."""
    return bytes_per_element * shard_elements(unit_elements(module), world_size)


# --------------------------------------------------------------------------- times (alpha-beta)
def all_reduce_ms(nbytes: float, world_size: int, link: str | Link = "loopback") -> float:
    """One ring all-reduce on a link (a preset's name, or a ``Link``, e.g. one fitted to this
    machine): 2(N-1) alpha + 2(N-1)/N S beta, in ms."""
    return 1e3 * collective_time("all_reduce", nbytes, world_size, LINKS[link] if isinstance(link, str) else link)
