"""Where the ranks parted: compare their sequences of collectives, say it in words a learner reads.

Every rank's flight recorder (``ddpkit.comm.flight``) holds its last collectives: per group, an index
(1, 2, ...), the op, bytes, dtype and labels; the line of code that issued one is found in the
rank's stack when it matters (``flight.where_in``). The Cluster's parent reads them when something
looks wrong (a rank reported a collective stuck for ``flight.STALL_S``, a rank finished while
others still run, a job ended in errors) and asks ``diagnose`` whether the ranks' sequences have
*parted* -- will never match again, however long one waits:

- **mismatch**: at the same index of the same group, two ranks issued different collectives
  (op, bytes or dtype): a skipped collective, a different op, different shapes;
- **finished**: a rank issued a collective that a rank of its group will never issue, because
  that one finished its job (it ran out of data: uneven inputs without ``Join``);
- **deadlock**: ranks wait in collectives the others have not issued and, blocked, never will
  (e.g. a collective issued on the wrong process group);
- **failed**: as "finished", but the rank that will never issue it failed or died. That is the
  failure's fault, not a desync: the Cluster raises ``RankError``, and stops the waiting ranks at
  once instead of waiting for a timeout.

A rank that is merely slow (still computing, the others waiting for it) has not parted: that is
for the timeout to decide. Nor is a rank whose ring no longer holds any of a group's collectives
(newer ones on other groups pushed them out) read as never having issued them (``RankView.knows``).
``Diagnosis.explain()`` is what ``ddpkit.DesyncError`` says first.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ddpkit.comm.flight import Entry, blocked_in_a_wait, where_in
from ddpkit.units import human_bytes

AROUND = 3  # collectives drawn before and after the one where the ranks parted

# What a rank was doing when the parent diagnosed (RankView.state)
ENDED = ("finished", "failed", "died")


@dataclass
class RankView:
    """What the parent knows of one rank: how its job stands, its ring, what it waits in."""

    rank: int
    state: str                    # "running", "finished", "failed" (its own error), "broken" (its
                                  # collective failed), "died", "stopped" (interrupted or killed by
                                  # the cluster while it was still running)
    entries: list | None = None   # its flight recorder's entries, oldest first (None: unreadable)
    waiting: tuple | None = None  # (group, index) it reported stuck in; a group is (ranks, ordinal)
    waited: float = 0.0           # for how long, when it reported
    note: str = ""                # how its job ended, in a few words ("exit code 3", the error's last line)
    stack: str = ""               # where it was, as text: its stuck report's stack, its traceback, or
                                  # faulthandler's dump when it died (``flight.where_in`` reads it)

    def last(self, group: tuple) -> int:
        """The index of the newest collective it issued in ``group`` (0: none)."""
        return max((e.index for e in self.entries or () if e.key == group), default=0)

    def knows(self, group: tuple) -> bool:
        """Does its ring tell how far it got in ``group``? Not when the ring holds none of the
        group's collectives and has dropped older ones (its oldest is not its first): a rank that
        issued many collectives on other groups since (e.g. a group of its own) has pushed the
        group's out. Then ``last`` says 0 and nothing can be concluded from it."""
        entries = self.entries or ()
        return not entries or entries[0].seq == 1 or any(e.key == group for e in entries)

    def entry(self, group: tuple, index: int) -> Entry | None:
        return next((e for e in self.entries or () if e.key == group and e.index == index), None)

    def pending(self) -> tuple | None:
        """The collective it is blocked in: the one it reported, or (its collective failed) its newest."""
        if self.waiting is not None:
            return self.waiting
        if self.state == "broken" and self.entries:
            return self.entries[-1].key, self.entries[-1].index
        return None


@dataclass
class Diagnosis:
    """Where the ranks parted: ``kind``, the collective (``group``, ``index``), what each rank did."""

    kind: str                     # "mismatch", "finished", "deadlock" or "failed" (see the module)
    group: int                    # the group: its ordinal among the groups of its ranks (0: the first)
    ranks: tuple                  # ... and its global ranks
    index: int
    issued: dict                  # rank -> its Entry at (group, index), or None
    views: dict = field(default_factory=dict)   # rank -> RankView
    lanes: dict = field(default_factory=dict)   # rank -> its entries of the group around index

    @property
    def ddp(self) -> bool:
        """Did a DDP wrapper issue the collectives around it (ddpkit's, or torch's buckets)?"""
        return any(_by_ddp(e) for lane in self.lanes.values() for e in lane)

    @property
    def key(self) -> tuple:
        return self.ranks, self.group

    def group_name(self) -> str:
        return group_name(self.key, len(self.views))

    def summary(self) -> str:
        return f"desync at collective #{self.index} of {self.group_name()}"

    def headline(self) -> str:
        ended = [r for r, v in self.views.items() if r in self.ranks and v.state in ENDED and not self.issued.get(r)]
        why = {"mismatch": "the ranks issued different collectives there",
               "finished": f"rank{_s(ended)} {_names(ended)} had finished {_their(ended)} job and will never issue it",
               "deadlock": "each rank waits in a collective the others have not issued (and, blocked, never will)",
               "failed": f"rank{_s(ended)} {_names(ended)} failed before issuing it"}[self.kind]
        return f"{self.summary()}: {why}"

    def explain(self) -> str:
        """The diagnosis: the headline, a line per rank, a hint, and the lanes around the index."""
        lines = [self.headline()]
        for r in sorted(self.views):
            lines.append(f"  rank {r}: {self.describe(r)}")
        hint = self.hint()
        if hint:
            lines.append(hint)
        lines.append(self.table())
        return "\n".join(lines)

    def describe(self, rank: int) -> str:
        """What ``rank`` issued at the index, or why it issued nothing there; and how it stands."""
        v, e = self.views[rank], self.issued.get(rank)
        state = _state(v)
        if rank not in self.ranks:
            return f"not in this group; {state}"
        if e is not None:
            if v.state == "finished":  # gloo let a mismatched collective return here: with what data?
                state = "its job finished: here the collective returned, so what it computed cannot be trusted"
            return f"{describe_entry(e)}; {state}"
        last = v.last(self.key)
        so_far = f"its last here was #{last}" if last else "none in this group"
        if v.entries is None:
            return f"(its record could not be read); {state}"
        where = v.pending()
        if where is not None and where != (self.key, self.index):
            other = v.entry(*where)
            what = f"collective #{where[1]} of {group_name(where[0], len(self.views))}"
            if other is not None:
                what += f": {describe_entry(other)}"
            return f"issued nothing there ({so_far}); it is waiting in {what}"
        if v.state == "finished":
            return f"issued nothing there: it finished its job after collective #{last}"
        return f"issued nothing there yet ({so_far}); {state}"

    def hint(self) -> str:
        if self.kind == "mismatch":
            return ("every rank must issue the same collectives in the same order, with the same sizes "
                    "and dtypes, on the same group")
        if self.kind == "finished":
            base = "a rank that runs out of data stops issuing the collectives the others still wait for"
            if self.ddp:
                return (f"{base}: use Join -- `with torch.distributed.algorithms.Join([model]):` around "
                        "the loop lets a finished rank shadow the others' steps (or give every rank the "
                        "same number of batches)")
            return (f"{base}: give every rank the same number of steps (with a DDP wrapper, Join does it: "
                    "`torch.distributed.algorithms.Join`)")
        if self.kind == "deadlock":
            return "check that every rank issues these collectives on the same process group"
        return ""

    def table(self) -> str:
        """The lanes as text: a row per index, a column per rank, ``>`` at the parted one."""
        ranks = sorted(r for r in self.views if r in self.ranks)
        width = 30
        head = "     #  " + "".join(f"rank {r}".ljust(width) for r in ranks)
        rows = [head.rstrip()]
        for i in self.indices():
            cells = []
            for r in ranks:
                e = next((x for x in self.lanes.get(r, ()) if x.index == i), None)
                cells.append((short_entry(e) if e else "").ljust(width))
            mark = ">" if i == self.index else " "
            rows.append(f"  {mark}{i:>3}  {''.join(cells)}".rstrip())
        return "\n".join(rows)

    def indices(self) -> list:
        """The indices the lanes show: ``AROUND`` before the parted one to ``AROUND`` after."""
        found = {e.index for lane in self.lanes.values() for e in lane}
        return [i for i in range(self.index - AROUND, self.index + AROUND + 1) if i in found or i == self.index]


def _s(ranks) -> str:
    return "s" if len(ranks) != 1 else ""


def _their(ranks) -> str:
    return "their" if len(ranks) != 1 else "its"


def _names(ranks) -> str:
    return ", ".join(map(str, ranks))


def _state(v: RankView) -> str:
    note = brief(v.note)
    if v.state == "running":
        if v.waiting is not None:
            return f"waiting in it for {v.waited:.1f} s"
        if v.stack and blocked_in_a_wait(v.stack):
            return "waiting (its stack ends in a collective's wait)"
        return "still running its job"
    return {"finished": "its job finished",
            "failed": f"it failed: {note}" if note else "it failed",
            "broken": f"its collective failed: {note}" if note else "its collective failed",
            "died": f"it died: {note}" if note else "it died",
            "stopped": "it was still running (stopped by the cluster)"}.get(v.state, v.state)


def brief(note: str, limit: int = 160) -> str:
    """An error's message, short: no C++ source locations; whole sentences up to ``limit``."""
    import re

    note = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", note).strip()
    if len(note) <= limit:
        return note
    cut = note.rfind(". ", 0, limit)
    return note[:cut + 1] if cut > 40 else note[:limit - 3] + "..."


def group_name(group: tuple, world: int | None = None) -> str:
    """``the default group (ranks 0, 1)``, ``the group of ranks 0, 2``, or ``group 1 of ranks 0, 1``
    (the second group made of those ranks: each group has a sequence of its own)."""
    ranks, ordinal = group
    who = ", ".join(map(str, ranks))
    if ordinal == 0 and world is not None and tuple(ranks) == tuple(range(world)):
        return f"the default group (ranks {who})"
    return f"the group of ranks {who}" if ordinal == 0 else f"group {ordinal} of ranks {who}"


def short_entry(e: Entry) -> str:
    """``all_reduce 8.0 MiB`` (``bucket=0``): what a lane shows of a collective."""
    text = e.op if e.op == "barrier" else f"{e.op} {human_bytes(e.nbytes, 1)}"
    return f"{text} {e.labels}" if e.labels else text


# the files of ddpkit's DDP wrappers (``Entry.via`` names the strategy file a collective came through)
DDP_FILES = ("naive.py", "bucketed.py", "overlapped.py", "ddp_module.py", "ddp_compat.py", "buckets.py",
             "comm_hooks.py", "zero1.py", "zero2.py", "zero_buckets.py")


def _by_ddp(e: Entry) -> bool:
    return "bucket=" in e.labels or e.via.split(":")[0] in DDP_FILES


def describe_entry(e: Entry) -> str:
    """``all_reduce of 8.0 MiB float32 (via overlapped.py: _sync_gradients), at job.py:40 in step:
    `loss.backward()``` (labels such as ``bucket=0`` while recording)."""
    what = e.op if e.op == "barrier" else f"{e.op} of {human_bytes(e.nbytes, 1)} {e.dtype}".rstrip()
    how = ", ".join(x for x in (f"via {e.via}" if e.via else "", e.labels) if x)
    if how:
        what += f" ({how})"
    return f"{what}, {where(e)}" if e.file else what


def where(e: Entry) -> str:
    """``at job.py:40 in step: `loss.backward()``` (the source line when this process can read it:
    the notebook's parent holds its cells' lines)."""
    import linecache

    text = f"at {e.file}:{e.line} in {e.function}"
    source = linecache.getline(e.file, e.line).strip() if e.file else ""
    return f"{text}: `{source}`" if source else text


# ---------------------------------------------------------------------- the rules
def diagnose(views: list[RankView]) -> Diagnosis | None:
    """Have the ranks' sequences parted? The first place they did, or None (they may yet meet)."""
    by_rank = {v.rank: v for v in views}
    for v in views:
        _locate(v)
    found = _mismatch(by_rank) or _blocked(by_rank) or _outrun(by_rank)
    if found is None:
        return None
    kind, group, index = found
    ranks = group[0]
    issued = {r: by_rank[r].entry(group, index) for r in ranks if r in by_rank}
    lanes = {r: [e for e in (by_rank[r].entries or ()) if e.key == group
                 and index - AROUND <= e.index <= index + AROUND] for r in ranks if r in by_rank}
    return Diagnosis(kind, group[1], tuple(ranks), index, issued, by_rank, lanes)


def _locate(v: RankView) -> None:
    """Give the collective a rank was in when it was seen (the one it waits in, or its newest when
    its collective failed or it died) the user's line from the rank's stack (``flight.where_in``)."""
    found = where_in(v.stack) if v.stack else None
    newest = (v.entries[-1].key, v.entries[-1].index) if v.entries else None
    where = v.pending() or (newest if v.state in ("died", "running") else None)  # running: its stack was asked for
    e = v.entry(*where) if found is not None and where is not None else None
    if e is not None:
        e.file, e.line, e.function, e.via = found


def _groups(by_rank) -> set:
    """Every group the ranks recorded a collective of: (ranks, ordinal)."""
    return {e.key for v in by_rank.values() for e in v.entries or ()}


def _mismatch(by_rank):
    """The first (group, index) where two ranks' collectives differ (the earliest issued, on the rank
    that issued it first; the same group's indices are in the same order on every rank)."""
    best = None
    for group in _groups(by_rank):
        seen: dict = {}  # index -> (signature, its place in the sequence of the first rank to issue it)
        for r in group[0]:
            for e in (by_rank[r].entries or ()) if r in by_rank else ():
                if e.key != group:
                    continue
                first = seen.setdefault(e.index, (e.signature(), e.seq))
                if first[0] != e.signature() and (best is None or first[1] < best[0]):
                    best = (first[1], group, e.index)
    return None if best is None else ("mismatch", *best[1:])


def _blocked(by_rank):
    """A rank blocked in a collective that will never complete: some rank of its group has not
    issued it and never will (it ended, or it is blocked too, in a wait that never ends)."""
    memo: dict = {}

    def stuck_for_good(r, path) -> str | None:  # None: it may still progress; else why not
        v = by_rank.get(r)
        if v is None or v.entries is None:
            return None
        if v.state in ENDED:
            return "finished" if v.state == "finished" else "failed"
        where = v.pending()
        if where is None:
            return None       # computing: it may yet issue what the others wait for
        if r in path:
            return "deadlock"
        if r in memo:
            return memo[r]
        group, index = where
        verdict = None  # one rank of the group that never issues it is enough to wait forever
        for m in group[0]:
            other = by_rank.get(m)
            if (m == r or other is None or other.entries is None or not other.knows(group)
                    or other.last(group) >= index):
                continue
            verdict = stuck_for_good(m, path | {r})
            if verdict is not None:
                break
        memo[r] = verdict
        return verdict

    for r in sorted(by_rank):
        v = by_rank[r]
        where = v.pending()
        if where is None or v.state in ENDED:
            continue
        why = stuck_for_good(r, frozenset())
        if why is not None:
            return why, *where
    return None


def _outrun(by_rank):
    """A rank still running issued a collective that a finished (or failed) rank of its group
    never issued: whatever it does now, it will wait for it forever (no report needed: torch's
    own DDP drops its Work handles, so its waits cannot be watched)."""
    for r in sorted(by_rank):
        v = by_rank[r]
        if v.state in ENDED or not v.entries:
            continue
        for group in {e.key for e in v.entries}:
            mine = v.last(group)
            for m in group[0]:
                other = by_rank.get(m)
                if other is None or other.entries is None or other.state not in ENDED or not other.knows(group):
                    continue
                if other.last(group) < mine:
                    kind = "finished" if other.state == "finished" else "failed"
                    return kind, group, other.last(group) + 1
    return None


__all__ = ["Diagnosis", "RankView", "diagnose", "describe_entry", "group_name", "short_entry"]
