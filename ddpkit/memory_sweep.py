"""Memory per rank against the number of ranks: what the ZeRO rungs save, and what they cannot.

    sweep = {n: memory_against_n(cluster_of_n, strategies) for n in (1, 2, 4)}   # names from strategies.table
    ddpkit.viz.plot_memory_against_n(sweep)       # stacked by category, the ZeRO formula beside

The ZeRO formulas count model states only; activations, DDP's buckets and FSDP's gathered units
do not shrink with N. ``memory_job`` (a Cluster job) trains a few AdamW steps and measures every
``memory.CATEGORIES`` of a steady step, plus ``optimizer_state_before_first_step``.
"""
from __future__ import annotations


def memory_job(strategy: str, workload=None, per_rank_batch: int = 32, steps: int = 2, optimizer: str = "adamw",
               bucket_cap_mb: float | None = None, seed: int = 0) -> dict:
    """A Cluster job: ``steps`` steps of ``strategy`` on ``workload``; this rank's bytes by category."""
    import torch.distributed as dist

    from ddpkit.experiment import wrap
    from ddpkit.memory import CATEGORIES, MODEL_STATES, measure_step
    from ddpkit.nested import map_leaves
    from ddpkit.rankside import device
    from ddpkit.trace import Recorder
    from ddpkit.workload import resolve

    if steps < 2:
        raise ValueError(f"steps must be >= 2 (the first step allocates the optimizer state), got {steps}")
    wl = resolve(workload, seed=seed)
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    rec = Recorder(rank=rank, world_size=world, device=str(dev))  # FSDP reports its unsharded bytes to it
    wrapped, opt = wrap(strategy, wl.build(seed), optimizer, bucket_cap_mb, recorder=rec)
    out: dict = {}
    for step in range(steps):
        # its own storage: a slice of the global batch would count the whole batch as activations
        batch = map_leaves(lambda t: t.clone(), wl.local_batch(step, per_rank_batch * world, rank, world, dev))
        rec.clear()
        sample = measure_step(wrapped, opt, batch, wl.compute_loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0:
            out["optimizer_state_before_first_step"] = sample["optimizer_state"]
    out.update({c: sample.get(c, 0) for c in CATEGORIES})
    out["unsharded_parameters"] = max((r.args.get("unsharded_parameters", 0) for r in rec.records
                                       if r.kind == "counter" and r.cat == "memory"), default=0)
    out["model_state"] = sum(out[c] for c in MODEL_STATES)
    out["total"] = sum(out[c] for c in CATEGORIES)
    return out


def memory_against_n(cluster, strategies, workload=None, per_rank_batch: int = 32, **job_kwargs) -> dict[str, dict]:
    """``memory_job`` for each strategy on ``cluster``: ``{strategy: the rank holding the most's
    measurement, with "world_size" and "ranks"}`` (``viz.plot_memory_against_n`` draws ``{n: this}``)."""
    out = {}
    for s in strategies:
        ranks = cluster.run(memory_job, s, workload, per_rank_batch=per_rank_batch, **job_kwargs)
        out[s] = dict(max(ranks, key=lambda r: r["total"]), world_size=cluster.world_size, ranks=ranks)
    return out


def formula_totals(sweep: dict, num_params: int) -> dict[tuple[str, int], float]:
    """``{(strategy, n): the ZeRO formula's model-state bytes per rank}`` (fp32 AdamW)."""
    from ddpkit.memory_formulas import predicted_model_state

    return {(s, n): predicted_model_state(s, num_params, n)["total"] for n, runs in sweep.items() for s in runs}
