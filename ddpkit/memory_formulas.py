"""What the ZeRO paper's formulas say a rank holds: per ZeRO stage, and per strategy of the table.

    zero_predictions(psi, n)                              # {DDP, ZeRO-1, ZeRO-2, ZeRO-3: {category: bytes}}
    predicted_model_state("zero2", parameter_count(m), n) # the stage a strategy follows, over its shard group

Model states only; which stage a strategy is, and over how many ranks, is its row in the table.
"""
from __future__ import annotations

from ddpkit.strategies.table import STRATEGIES

# Which ZeRO stage each ddpkit strategy is, for putting predictions beside measurements.
STAGE_OF_STRATEGY = {name: row.zero_stage for name, row in STRATEGIES.items()}


def zero_predictions(num_params: int, world_size: int, k: float = 8, param_bytes: float = 4,
                     grad_bytes: float = 4) -> dict[str, dict[str, float]]:
    """Model-state bytes per rank for DDP and ZeRO-1/2/3 (Rajbhandari et al., 2020, section 5;
    ``docs/papers.md``).

    Ψ = ``num_params``, N = ``world_size``, K = optimizer bytes per parameter; defaults fp32 Adam
    (4Ψ + 4Ψ + 8Ψ). The paper's mixed precision is ``param_bytes=2, grad_bytes=2, k=12``."""
    if world_size < 1 or num_params < 0:
        raise ValueError(f"need world_size >= 1 and num_params >= 0, got {world_size}, {num_params}")
    p, g, o, n = param_bytes * num_params, grad_bytes * num_params, k * num_params, world_size
    stages = {
        "DDP": (p, g, o),            # everything replicated
        "ZeRO-1": (p, g, o / n),     # optimizer state sharded
        "ZeRO-2": (p, g / n, o / n),  # ... and gradients
        "ZeRO-3": (p / n, g / n, o / n),  # ... and parameters (FSDP full sharding)
    }
    return {name: {"parameters": a, "gradients": b, "optimizer_state": c, "total": a + b + c}
            for name, (a, b, c) in stages.items()}


def parameter_count(model) -> int:
    """Ψ of the ZeRO formulas: the trainable parameters of ``model`` (an ``nn.Module``, or a
    ``ddpkit.Workload``, whose model is built here once), a tied parameter counted once."""
    from ddpkit.workload import Workload

    module = model.build() if isinstance(model, Workload) else model
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def shard_group_size(strategy: str, world_size: int, topology=None) -> int:
    """Over how many ranks ``strategy`` shards its state at ``world_size``: all, except hybrid
    sharding, which shards inside a node of ``topology`` (None: nodes of 2)."""
    return STRATEGIES[strategy].shard_group_size(world_size, topology)


def predicted_model_state(strategy: str, num_params: int, world_size: int, topology=None,
                          **bytes_per_param) -> dict[str, float]:
    """The ZeRO formula ``strategy`` follows (its table row's stage), sharded over its shard group
    (hybrid sharding: a node of ``topology``, as above): ``{parameters, gradients,
    optimizer_state, total}`` bytes per rank."""
    stage = STRATEGIES[strategy].zero_stage
    return zero_predictions(num_params, shard_group_size(strategy, world_size, topology), **bytes_per_param)[stage]


__all__ = ["STAGE_OF_STRATEGY", "zero_predictions", "parameter_count", "shard_group_size", "predicted_model_state"]
