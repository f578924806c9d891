"""The reference answers: what the course's formulas say for a question's setting, to the byte.

The ring and ZeRO formulas count Ψ parameters; a run moves flat buffers padded to a multiple of
N (``FlatLayout``) by the kit's own layouts, so each reference is the formula over those buffers,
exact to the byte. Models are built on the meta device (shapes only).
"""
from __future__ import annotations

from ddpkit.network import ring_bytes
from ddpkit.strategies.buckets import assign_buckets, layout
from ddpkit.strategies.flat_layout import FlatLayout
from ddpkit.units import human_bytes

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


def fsdp_bytes(world_size: int, model_kwargs: dict | None = None, module=None, reshard: bool = True) -> float:
    """FSDP: per padded unit two all-gathers (one without ``reshard``) and a reduce-scatter: 3 x (N-1)/N x S."""
    s = 4 * padded_elements(unit_elements(meta_model(model_kwargs, module)), world_size)
    return (1 + reshard) * ring_bytes("all_gather", s, world_size) + ring_bytes("reduce_scatter", s, world_size)


def torch_zero_bytes(world_size: int, model_kwargs: dict | None = None) -> float:
    """torch's ZeroRedundancyOptimizer: DDP's all-reduce, then each parameter broadcast: 3 x (N-1)/N x S."""
    sizes = param_sizes(meta_model(model_kwargs))
    return ddp_bytes(world_size, model_kwargs) + sum(ring_bytes("broadcast", s, world_size) for s in sizes)


def hsdp_inter_node_bytes(world_size: int, ranks_per_node: int, model_kwargs: dict | None = None) -> float:
    """Hybrid sharding: each unit's 1/k shard all-reduced among W = N/k nodes (FSDP paper: 2M(W-1)/(GW))."""
    k, w = ranks_per_node, world_size // ranks_per_node
    shard = 4 * shard_elements(unit_elements(meta_model(model_kwargs)), k)
    return ring_bytes("all_reduce", shard, w)


# --------------------------------------------------------------------------- memory per rank
def ddp_model_state(model_kwargs: dict | None = None, state_bytes: int = 8) -> int:
    """DDP with AdamW: every parameter, its gradient and its two moments on every rank (16 Psi)."""
    return (8 + state_bytes) * sum(param_sizes(meta_model(model_kwargs))) // 4


def zero1_model_state(world_size: int, model_kwargs: dict | None = None, state_bytes: int = 8,
                      bucket_cap_mb: float | None = None) -> int:
    """ZeRO-1 with AdamW: every parameter and gradient, and this rank's share of the moments."""
    psi = sum(param_sizes(meta_model(model_kwargs))) // 4
    return 8 * psi + zero1_optimizer_state(world_size, model_kwargs, state_bytes, bucket_cap_mb)


def zero1_optimizer_state(world_size: int, model_kwargs: dict | None = None, state_bytes: int = 8,
                          bucket_cap_mb: float | None = None) -> int:
    """ZeRO-1 with AdamW: 8 bytes x rank 0's shard of each padded bucket (the ZeRO paper's K Ψ / N)."""
    return state_bytes * shard_elements(bucket_elements(meta_model(model_kwargs), bucket_cap_mb), world_size)


def fsdp_model_state(world_size: int, module, bytes_per_element: int = 12) -> int:
    """FSDP with SGD momentum in fp32: 12 bytes x this rank's shard of every unit (16Ψ/N with K = 4)."""
    return bytes_per_element * shard_elements(unit_elements(module), world_size)


# --------------------------------------------------------------------------- the words of a question
def mlp_facts(model_kwargs: dict | None = None) -> dict[str, str]:
    """What a question may say of the course's MLP, derived: ``gradients``, ``tensors``, ``parameters``,
    ``buckets`` (1 MiB)."""
    module = meta_model(model_kwargs)
    sizes = param_sizes(module)
    return {"gradients": human_bytes(sum(sizes)), "tensors": str(len(sizes)),
            "parameters": f"{sum(sizes) / 4 / 1e6:.2g} M", "buckets": str(len(bucket_elements(module, 1.0)))}


def ours(zero_stage: str, *, overlap: bool | None = None, hybrid: bool = False, torch: bool = False) -> str:
    """The table's strategy following ``zero_stage`` (overlap, hybrid, ours or torch's): questions name
    what they compare by what it is; the table spells the names."""
    from ddpkit.strategies.table import STRATEGIES

    names = [s.name for s in STRATEGIES.values()
             if s.zero_stage == zero_stage and s.hybrid == hybrid and s.torch_native == torch and s.cost.bucketed
             and (overlap is None or s.cost.overlap == overlap)]
    if len(names) != 1:
        raise LookupError(f"the table has {len(names)} strategies for {zero_stage} overlap={overlap} "
                          f"hybrid={hybrid} torch={torch}: {names}")
    return names[0]
