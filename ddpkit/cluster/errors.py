"""``RankError``: what ``Cluster.run()`` (or a start) raises when ranks fail, with their tracebacks;
``DesyncError``: the ranks' sequences of collectives parted (``ddpkit.comm.desync``);
``GpuOutOfMemoryError``: a rank ran out of GPU memory (``ddpkit.cluster.gpu_memory``)."""
from __future__ import annotations


class RankError(RuntimeError):
    """One or more ranks failed; ``.failures`` maps each failed rank to its traceback text,
    ``.affected`` the ranks that went down *because* of them to what happened to them (interrupted,
    killed, thrown out of a collective); ``.note`` says what happened to the cluster afterwards."""

    def __init__(self, failures: dict[int, str], note: str = "", affected: dict[int, str] | None = None):
        self.failures = dict(sorted(failures.items()))
        self.affected = dict(sorted((affected or {}).items()))
        self.ranks = list(self.failures)
        self.note = note
        super().__init__(self._message())

    def _message(self) -> str:
        s = "s" if len(self.ranks) > 1 else ""
        head = f"rank{s} {', '.join(map(str, self.ranks))} failed"
        if self.affected:
            head += f"; rank(s) {', '.join(map(str, self.affected))} went down with it"
        parts = [head, *self._details(f"went down after rank{s} {', '.join(map(str, self.ranks))} failed")]
        if self.note:
            parts.append(f"[ddpkit] {self.note}")
        return "\n".join(parts)

    def _details(self, affected_why: str) -> list[str]:
        parts = [f"--- rank {r} ---\n{tb.rstrip()}" for r, tb in self.failures.items()]
        parts += [f"--- rank {r} ({affected_why}) ---\n{tb.rstrip()}" for r, tb in self.affected.items()]
        return parts


class DesyncError(RankError):
    """The ranks' sequences of collectives parted (``ddpkit.comm.desync``): they will never meet again.

    ``.diagnosis`` (a ``ddpkit.comm.desync.Diagnosis``) says where (``.group``, ``.index``) and what
    each rank issued there; ``.failures`` holds the ranks of the parted group, ``.affected`` the others."""

    def __init__(self, diagnosis, failures: dict[int, str], note: str = "",
                 affected: dict[int, str] | None = None):
        self.diagnosis = diagnosis
        self.index, self.group = diagnosis.index, diagnosis.ranks
        super().__init__(failures, note, affected)

    def _message(self) -> str:
        parts = [self.diagnosis.explain()]
        if self.note:
            parts.append(f"[ddpkit] {self.note}")
        parts += self._details("went down with them")
        return "\n".join(parts)


class GpuOutOfMemoryError(RankError):
    """A rank ran out of GPU memory. ``.out_of_memory``: those ranks; ``.held``: rank -> ``GpuHeld``,
    what each held on its GPU when its job ended (the message says it first, and how to fit)."""

    def __init__(self, explanation: str, out_of_memory: list[int], held: dict, failures: dict[int, str],
                 note: str = "", affected: dict[int, str] | None = None):
        self.explanation, self.out_of_memory, self.held = explanation, list(out_of_memory), dict(held)
        super().__init__(failures, note, affected)

    def _message(self) -> str:
        parts = [self.explanation]
        if self.note:
            parts.append(f"[ddpkit] {self.note}")
        parts += self._details("went down with them")
        return "\n".join(parts)

