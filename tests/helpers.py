"""What the strategy tests share: small models, a tolerance, the single-process reference, one
training loop for a rank, and a recorder that counts.

The reference (``train_single_process``) is what every strategy must equal; many tests ask for
the same one, so it is computed once per distinct call. Callers must not modify the tensors.
"""
from __future__ import annotations

import functools

from ddpkit.experiment import local_batch, train_single_process, train_step
from ddpkit.trace.seam import NullRecorder

SMALL_MLP = dict(width=16, depth=4)                          # 5 Linears, 1258 parameters
SMALL_GPT = dict(vocab=16, dim=16, layers=1, heads=2, seq=8)  # tied head, LayerNorm, attention
SMALL_CAP = 0.001  # MiB = 1048 bytes: the small MLP splits into several buckets
TOL = 1e-5


@functools.cache
def _reference(model_name, optimizer, steps, batch, kwargs_items):
    return train_single_process(model_name, optimizer, steps=steps, global_batch_size=batch, **dict(kwargs_items))


def reference_params(model_name: str, optimizer: str = "sgd", steps: int = 5, batch: int = 24, **model_kwargs) -> dict:
    """``train_single_process(...)`` after ``steps`` steps on global batches of ``batch``."""
    return _reference(model_name, optimizer, steps, batch, tuple(sorted(model_kwargs.items())))


def train_on_rank(model, module, optimizer, steps: int, batch: int, first_step: int = 0) -> None:
    """Inside a rank: ``train_step`` on this rank's slice of global batches ``first_step``,
    ``first_step + 1``, ... (``module`` is the unwrapped model, which ``local_batch`` reads)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(first_step, first_step + steps):
        train_step(model, optimizer, *local_batch(module, batch, step, rank, world))


def ranks(n: int) -> str:
    """How a test id names a world size: "1rank", "2ranks", ..."""
    return "1rank" if n == 1 else f"{n}ranks"


class CountingRecorder(NullRecorder):
    """Keeps, in order, what a strategy reports, as (what, value, where) triples:

        ("all_reduce", nbytes, bucket)    a collective launched (any name; FSDP's: where = unit name)
        ("ready", param_name, bucket)     a gradient became ready
        ("mark", what, None)              a point the test marked with ``mark(what)``

    and, apart, every memory sample (``{category: bytes}``). ``enabled=False`` behaves as
    recording off (strategies skip the work only recording needs), while still counting.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.events: list[tuple] = []
        self.memory_samples: list[dict] = []

    def collective(self, name, work, nbytes, **fields):
        self.events.append((name, nbytes, fields.get("bucket", fields.get("unit"))))

    def grad_ready(self, param_name, **fields):
        self.events.append(("ready", param_name, fields.get("bucket")))

    def memory(self, **bytes_by_category):
        self.memory_samples.append(bytes_by_category)

    def mark(self, what: str) -> None:
        self.events.append(("mark", what, None))

    def clear(self) -> None:
        self.events.clear()
        self.memory_samples.clear()

    # ------------------------------------------------------------------ queries
    def collectives(self, name: str | None = None) -> list[tuple]:
        """The collectives launched (only those called ``name``, if given), in order."""
        return [e for e in self.events if e[0] not in ("ready", "mark") and (name is None or e[0] == name)]

    def ready(self) -> list[tuple]:
        """The ("ready", param_name, bucket) events, in order."""
        return [e for e in self.events if e[0] == "ready"]

    def index(self, mark: str) -> int:
        """Where ``mark(mark)`` was called in ``events``."""
        return self.events.index(("mark", mark, None))
