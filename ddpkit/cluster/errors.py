"""``RankError``: what ``Cluster.run()`` (or a start) raises when ranks fail, with their tracebacks."""
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
        s = "s" if len(self.ranks) > 1 else ""
        head = f"rank{s} {', '.join(map(str, self.ranks))} failed"
        if self.affected:
            head += f"; rank(s) {', '.join(map(str, self.affected))} went down with it"
        parts = [head]
        for r, tb in self.failures.items():
            parts.append(f"--- rank {r} ---\n{tb.rstrip()}")
        for r, tb in self.affected.items():
            parts.append(f"--- rank {r} (went down after rank{s} {', '.join(map(str, self.ranks))} "
                         f"failed) ---\n{tb.rstrip()}")
        if note:
            parts.append(f"[ddpkit] {note}")
        super().__init__("\n".join(parts))
