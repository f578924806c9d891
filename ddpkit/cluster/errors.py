"""``RankError``: what ``Cluster.run()`` (or a start) raises when ranks fail, with their tracebacks;
``DesyncError``: the ranks' sequences of collectives parted (``ddpkit.comm.desync``);
``GpuOutOfMemoryError``: a rank ran out of GPU memory (``ddpkit.cluster.gpu_memory``)."""
from __future__ import annotations


class RankError(RuntimeError):
    """One or more ranks failed; ``.failures`` maps each failed rank to its traceback text.

    ``.affected`` maps the ranks that went down *because* of those failures to what happened
    to them: interrupted or killed by the cluster while still running (usually stuck in a
    collective waiting for a failed rank), or thrown out of a collective by torch.distributed
    when a peer died. ``.note`` says what happened to the cluster afterwards.
    """

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

    ``.diagnosis`` (a ``ddpkit.comm.desync.Diagnosis``) says where: the collective's index (``.index``)
    in the sequence of its group (``.group``: the group's ranks), and for each rank what it
    issued there, or that it finished its job, or that it is still computing. The message says
    that first; the cluster's note (its ranks were restarted: a parted process group cannot be
    trusted) and each rank's traceback or stack follow. ``.failures`` holds the ranks of the
    parted group, ``.affected`` the others.
    """

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
    """A rank ran out of GPU memory (torch's ``OutOfMemoryError``). ``.out_of_memory``: those ranks;
    ``.held``: what each rank reported holding on its GPU when its job ended (rank ->
    ``ddpkit.cluster.gpu_memory.GpuHeld``). The message says that first -- what every rank sharing
    the GPU held, and how to fit -- then the cluster's note and each rank's traceback."""

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

