"""What a rank holds on its GPU, and what to tell a learner when a rank runs out of it.

A worker on a GPU reports after every job what it held (``GpuHeld.now``). Ranks sharing a GPU draw
on one pool, so the ``GpuOutOfMemoryError`` names what *each* of them held, and how to fit.
"""
from __future__ import annotations

from dataclasses import dataclass

from ddpkit.memory import cuda_context_bytes
from ddpkit.units import human_bytes


@dataclass(frozen=True)
class GpuHeld:
    """What one rank held on its GPU (bytes) when a job ended."""

    device: str                     # "cuda:0"
    allocated: int                  # the caching allocator's live bytes
    peak: int                       # its most since the job began
    reserved: int                   # what it holds from the GPU (freed blocks cached for reuse included)
    context: int | None             # outside the allocator, mostly the CUDA context (None: NVML cannot tell)
    cap: int | None                 # its cap (Cluster(memory_fraction=)), or None
    total: int                      # the GPU's memory

    @classmethod
    def now(cls, device, fraction: float | None = None) -> GpuHeld:
        """This rank's figures on ``device`` now (``fraction``: its cap, as a fraction of the GPU)."""
        import torch

        dev = torch.device(device)
        total = torch.cuda.get_device_properties(dev).total_memory
        return cls(str(dev), torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev),
                   torch.cuda.memory_reserved(dev), cuda_context_bytes(dev),
                   None if fraction is None else int(fraction * total), total)

    def describe(self) -> str:
        outside = f", {human_bytes(self.context)} outside it" if self.context is not None else ""
        cap = f" (capped at {human_bytes(self.cap)})" if self.cap is not None else ""
        return (f"{human_bytes(self.allocated)} in use, peak {human_bytes(self.peak)}, "
                f"{human_bytes(self.reserved)} reserved{outside}{cap}")


# What fits more on one GPU, in the order a learner can try them
HOW_TO_FIT = ("to fit: fewer ranks on the GPU (each holds its own model states, activations and CUDA context), "
              "a smaller batch per rank (its activations), or a strategy that shards the model states (zero1: "
              "optimizer state / N; zero2: gradients too; fsdp: parameters too; "
              "ddpkit.memory_formulas.predicted_model_state gives the bytes); Cluster(..., memory_fraction=f) caps "
              "each rank at a fraction f of its GPU, so one that outgrows its share fails alone instead of starving "
              "the others")


def explain_out_of_memory(out_of_memory: dict[int, str], held: dict[int, GpuHeld], devices: dict[int, str]) -> str:
    """The head of a ``GpuOutOfMemoryError``: which rank(s) ran out, what every rank on that GPU held
    (``held``; ``devices`` for those that did not report), and how to fit."""
    def where(rank: int) -> str:
        return held[rank].device if rank in held else devices.get(rank, "?")

    lines = []
    for device in dict.fromkeys(where(r) for r in out_of_memory):
        ran_out = [r for r in out_of_memory if where(r) == device]
        sharing = sorted(r for r in set(devices) | set(held) if where(r) == device)
        size = next((f" ({human_bytes(held[r].total)})" for r in sharing if r in held), "")
        who = f"rank {ran_out[0]}" if len(ran_out) == 1 else f"ranks {', '.join(map(str, ran_out))}"
        lines.append(f"{who} ran out of GPU memory on {device}{size}: {out_of_memory[ran_out[0]]}")
        others = f"shared by ranks {', '.join(map(str, sharing))}" if len(sharing) > 1 else "not shared"
        lines.append(f"{device} is {others}; what each held when its job ended (the caching allocator's bytes "
                     "in use, its peak and what it reserved from the GPU; outside it, mostly the CUDA context):")
        for r in sharing:
            said = held[r].describe() if r in held else "not reported (it was stopped before it could say)"
            lines.append(f"  rank {r}: {said}{' <- ran out' if r in ran_out else ''}")
    lines.append(HOW_TO_FIT[0].upper() + HOW_TO_FIT[1:] + ".")
    return "\n".join(lines)


__all__ = ["GpuHeld", "HOW_TO_FIT", "explain_out_of_memory"]
