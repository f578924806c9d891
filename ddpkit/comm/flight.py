"""The flight recorder: each rank's last ``SLOTS`` collectives, kept where its parent can read them.

ddpkit's process group hands every collective to ``FlightRecorder.issue`` *before* launching it,
always (recording on or off): which group, its index in that group (1 for the group's first
collective), the op, the bytes, the dtype and, while recording, the strategy's labels (bucket,
unit: a recorder that is off opens no ``labels()`` block, see ``ddpkit.trace.seam``). That is the
sequence ``ddpkit.comm.desync`` compares across ranks when they part.

The user's line of code that issued a collective is taken *lazily*, from a stack, when it
matters: the watchdog's report of a stuck collective carries the job thread's stack, a rank that
died leaves faulthandler's dump, a failed collective its traceback; ``where_in`` finds the first
frame outside torch, ddpkit and the standard library there, and the ddpkit strategy code the
call came through. Walking the stack on every collective instead (15-25 frames of torch and
autograd between a collective and the user's line) cost more than all the rest the recorder does
per collective, which an FSDP step issues by the dozen (``python benchmarks/bench_desync.py``
measures what the recorder costs a step).

Why shared memory. A collective that parts the ranks may kill one outright: gloo aborts a rank
that receives more bytes than it expects (``op.preamble.length <= op.nbytes``), within
milliseconds, before any Python could report. So the ring is a file mapped into memory
(``attach``; the Cluster's parent makes one per rank and reads it after the rank is gone, like an
aircraft's recorder). Outside a Cluster (torchrun, a test) the ring is a plain bytearray.

Cost. Per collective: a dict look-up (its text's number), a 32-byte slot written as four int64
stores, and a weak reference to the ``Work`` (``benchmarks/bench_desync.py``). Between two
collectives an FSDP step runs enough other code to evict the interpreter's caches, so what counts
is how many Python operations the path runs, not which: four stores into a list cost there what
they cost into the ring, and reading the strategy's labels (while recording) as much as the stores.
A weak reference, not a strong one: holding a Work holds its tensors, which would change what
``ddpkit.memory`` sees.

The watchdog (one daemon thread, started by ``attach``) looks every ``WATCH_S`` at the oldest
collective not yet completed; once it has waited longer than ``STALL_S`` during a job, it
reports it to the parent (``report("stuck", ...)``, the worker's, with the job thread's stack), and
reports again when it completes after all. Only ``Work``s someone still holds can be watched:
torch's own DDP drops its Python handle at once, so a rank stuck there is found by the other
rule (a rank that finished while this one issued more, see ``ddpkit.comm.desync``).
"""
from __future__ import annotations

import collections
import contextlib
import mmap
import os
import re
import struct
import sys
import sysconfig
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field

SLOTS = 512          # collectives kept per rank: the newest ones (a ring)
STALL_S = 1.0        # a collective pending this long during a job is reported as stuck
WATCH_S = 0.25       # how often the watchdog looks (so a report comes STALL_S to STALL_S + WATCH_S late)

_MAGIC = b"DDPKFLT2"
_HEADER = struct.Struct("<8sqqq")            # magic, pid, job, slots
_HEADER_SIZE = 64
# A slot, 32 bytes: seq (1, 2, ... on this rank; 0: empty), bytes, index in the group, its text's
# number, seq again (a reader that finds the two differ read it half written). The texts follow
_SLOT = struct.Struct("<qqIIq")
TEXTS = 512
_TEXT = struct.Struct("<H254s")              # its length, the text
_SEP = b"\x1f"


def _classify(filename: str) -> str:
    """"user", "lib" (torch, the standard library, installed packages), "ddpkit", "strategy"
    (ddpkit's strategies) or "worker" (the Cluster's job loop, which calls the job)."""
    if filename.startswith(_DDPKIT_DIR):
        if filename.startswith(_STRATEGIES_DIR):
            return "strategy"
        return "worker" if filename.endswith(os.sep + _WORKER_FILE) else "ddpkit"
    if filename.startswith((_TORCH_DIR, _STDLIB_DIR)) or "-packages" + os.sep in filename:
        return "lib"  # torch, the standard library, installed libraries (site- or dist-packages)
    return "user"


def _dirs():
    import importlib.util

    torch = importlib.util.find_spec("torch")  # found, not imported: the parent reads rings too
    return (os.path.dirname(os.path.abspath(torch.origin)) + os.sep,
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # ddpkit/, above comm/
            os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep)


_TORCH_DIR, _DDPKIT_DIR, _STDLIB_DIR = _dirs()
_STRATEGIES_DIR = os.path.join(_DDPKIT_DIR, "strategies") + os.sep
_WORKER_FILE = os.path.join("cluster", "worker.py")  # the Cluster's job loop, which calls the job


@dataclass
class Entry:
    """One collective as a rank issued it (what the parent reads back from the ring)."""

    seq: int             # its place among all this rank's collectives (1, 2, ...)
    group: int           # the group's ordinal among the groups of the same ranks (0: the first)
    index: int           # its place in the group's sequence (1 for the group's first)
    nbytes: int          # the full size S (all-reduce: the buffer; all-gather: the output)
    op: str              # "all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier"
    dtype: str = ""
    ranks: tuple = ()    # the group's global ranks
    labels: str = ""     # the issuing strategy's labels, e.g. "bucket=0" or "unit=layers.0" (recording only)
    file: str = ""       # where the user's code issued it (filled in from a stack: ``where_in``)
    line: int = 0
    function: str = ""
    via: str = ""        # the ddpkit strategy code it came through, e.g. "overlapped.py: _sync_gradients"

    @property
    def key(self) -> tuple:
        """The group, as every member names it: (its ranks, ordinal)."""
        return self.ranks, self.group

    def signature(self) -> tuple:
        """What every rank of the group must agree on for this collective to match."""
        return (self.op, self.nbytes, self.dtype)


# What the watchdog keeps of a collective issued and not yet seen completed: a list (the cheapest
# thing to make on every collective), [seq, group, index, weak ref to its Work (None while it is
# being launched), when the watchdog first saw it pending, reported stuck?]
_SEQ, _GROUP, _INDEX, _WORK, _SEEN, _REPORTED = range(6)


@dataclass
class FlightRecorder:
    """This rank's ring of recent collectives (``issue``), and the watchdog (``attach``)."""

    slots: int = SLOTS
    enabled: bool = True           # False only to measure what it costs (benchmarks/bench_desync.py)
    buf: object = field(default=None, repr=False)
    groups: list = field(default_factory=list)   # group number -> (its global ranks, ordinal)
    _seq: int = 0
    _pending: collections.deque = field(default_factory=collections.deque, repr=False)
    _texts: dict = field(default_factory=dict, repr=False)    # (op, dtype, group, *labels) or text -> number
    _written: int = 0              # texts written into the ring
    _q: object = field(default=None, repr=False)  # the slots as int64s (``_use``), or None
    path: str | None = None
    job: int = 0                   # the job running now (0: none), as the parent numbers them
    watchdog: threading.Thread | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.buf is None:
            self.buf = bytearray(ring_size(self.slots))
            _HEADER.pack_into(self.buf, 0, _MAGIC, os.getpid(), 0, self.slots)
        self._use(self.buf)

    def _use(self, buf) -> None:
        """Write slots into ``buf`` from now on: through a view of its slots as int64s, four
        stores a slot (seq, bytes, index | text << 32, seq), the layout ``_SLOT`` reads back on a
        little-endian machine; ``_SLOT.pack_into`` elsewhere. In an FSDP step, whose caches are cold
        between collectives, the stores cost less than ``pack_into`` (``benchmarks/bench_desync.py``
        times ``issue``)."""
        self.buf = buf
        self._q = (memoryview(buf).cast("B")[_HEADER_SIZE:_HEADER_SIZE + self.slots * _SLOT.size].cast("q")
                   if sys.byteorder == "little" else None)

    # ------------------------------------------------------------------ the hot path
    def new_group(self, ranks) -> int:
        """A group was created: its number here (what ``issue`` takes). In the records a group is
        its ranks and its ordinal among the groups of the same ranks (0 for the first): what every
        member calls it alike, since a rank only creates the groups it is in, and torch has every
        rank create groups in the same order."""
        ranks = tuple(ranks)
        ordinal = sum(1 for g in self.groups if g[0] == ranks)
        self.groups.append((ranks, ordinal))
        return len(self.groups) - 1

    def issue(self, group: int, index: int, op: str, nbytes: int, dtype, labels) -> list | None:
        """Note a collective about to be launched; ``launched(p, work)`` after (``p``: what the
        watchdog watches, None when there is none)."""
        if not self.enabled:
            return None
        self._seq = seq = self._seq + 1
        fields = labels.fields if labels is not None else None
        key = (op, dtype, group, *fields.items()) if fields else (op, dtype, group)
        try:
            text = self._texts[key]
        except (KeyError, TypeError):  # new, or a label that cannot be hashed (a list of names)
            text = self._number(op, dtype, group, fields)
            if len(self._texts) < 4096:
                with contextlib.suppress(TypeError):
                    self._texts[key] = text
        q = self._q
        if q is not None:  # seq first and again last: a reader that finds the two differ read it half written
            at = (seq % self.slots) * 4
            q[at] = seq
            q[at + 1] = nbytes
            q[at + 2] = (index & 0xFFFFFFFF) | text << 32
            q[at + 3] = seq
        else:
            _SLOT.pack_into(self.buf, _HEADER_SIZE + (seq % self.slots) * 32, seq, nbytes, index, text, seq)
        if self.watchdog is None:  # nobody watches (outside a Cluster): keep nothing pending
            return None
        p = [seq, group, index, None, 0.0, False]
        self._pending.append(p)
        return p

    def _number(self, op: str, dtype, group: int, fields) -> int:
        """The number of the text ``op\x1fdtype\x1franks\x1fordinal[\x1flabels]``, written into the ring
        the first time it is used (labels left out near the table's end; past it, the last is reused)."""
        ranks, ordinal = self.groups[group]
        parts = [op, str(dtype or "").removeprefix("torch."), ",".join(map(str, ranks)), str(ordinal)]
        if fields and self._written < TEXTS - 64:
            parts.append(" ".join(f"{k}={v}" for k, v in fields.items())[:60])
        text = _SEP.join(p.encode() for p in parts)[:_TEXT.size - 2]
        if text not in self._texts:
            self._texts[text], self._written = min(self._written, TEXTS - 1), self._written + 1
            _TEXT.pack_into(self.buf, ring_size(self.slots, self._texts[text]), len(text), text)
        return self._texts[text]

    @staticmethod
    def launched(p: list | None, work) -> None:
        if p is not None and work is not None:
            p[_WORK] = weakref.ref(work)

    # ------------------------------------------------------------------ shared with the parent
    def attach(self, path: str, job: int, report) -> None:
        """Keep the ring in ``path`` (made by the Cluster's parent) from now on, and start the
        watchdog, which tells ``report(kind, **payload)`` of a collective stuck and unstuck;
        ``job``: the job about to run. Called by the worker before each job."""
        shared = _map(path, len(self.buf)) if path != self.path else None
        if shared is not None:
            shared[:] = bytes(self.buf)  # what was issued before (the group's first collectives)
            _HEADER.pack_into(shared, 0, _MAGIC, os.getpid(), 0, self.slots)
            self._use(shared)
            self.path = path
            _dump_stacks_on_request(path + ".stack")
        if self.watchdog is None:
            self.watchdog = threading.Thread(target=self._watch, args=(report,), name="ddpkit-flight-watchdog",
                                             daemon=True)
            self.watchdog.start()
        self.begin_job(job)

    def begin_job(self, job: int) -> None:
        self.job = job
        _HEADER.pack_into(self.buf, 0, _MAGIC, os.getpid(), job, self.slots)

    def end_job(self) -> None:
        self.job = 0

    def _watch(self, report) -> None:
        main = threading.main_thread().ident
        while True:
            time.sleep(WATCH_S)
            pending = self._pending
            while pending:  # forget what completed (or what nobody holds any more)
                p = pending[0]
                if p[_WORK] is None:
                    break   # being launched right now
                work = p[_WORK]()
                if work is not None and not work.is_completed():
                    break
                pending.popleft()
                if p[_REPORTED]:
                    report("unstuck", seq=p[_SEQ])
            if not pending or not self.job:
                continue
            p, now = pending[0], time.monotonic()
            if not p[_SEEN]:
                p[_SEEN] = now  # stuck is measured from here: the hot path reads no clock
            elif now - p[_SEEN] >= STALL_S and not p[_REPORTED]:
                p[_REPORTED] = True
                frame = sys._current_frames().get(main)
                stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
                ranks, ordinal = self.groups[p[_GROUP]]
                report("stuck", seq=p[_SEQ], ranks=list(ranks), group=ordinal, index=p[_INDEX],
                                waited=now - p[_SEEN], stack=_from_the_job(stack), job=self.job)


def _dump_stacks_on_request(path: str) -> None:
    """On SIGUSR1, faulthandler writes every thread's stack to ``path`` (appending: the parent
    empties it before asking). It works while the job thread is blocked inside a C++ collective,
    where no Python signal handler would run: the parent asks when the ranks parted."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=open(path, "a"), all_threads=True)  # noqa: SIM115 (kept open)


def job_thread(dump: str) -> str:
    """From faulthandler's dump of every thread, the job thread's stack (the one the worker's
    ``main`` runs), else the whole dump."""
    for block in dump.split("\n\n"):
        if " in main" in block and _WORKER_FILE in block:
            return block.strip()
    return dump


def _map(path: str, size: int):
    """``path`` mapped into memory, shared with every process that maps it; None if it cannot be
    (then the parent cannot read this rank's record; its jobs run all the same)."""
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            os.ftruncate(fd, size)
            return mmap.mmap(fd, size)
        finally:
            os.close(fd)
    except OSError:
        return None


def _from_the_job(stack: str) -> str:
    """The stack from the job's own frame down (the worker's loop above it is noise)."""
    marker = _WORKER_FILE
    lines = stack.splitlines(keepends=True)
    cut = 0
    for i, line in enumerate(lines):
        if line.lstrip().startswith("File ") and marker in line:
            cut = i + 2  # skip the worker's frame and its source line
    return "".join(lines[cut:])


# ---------------------------------------------------------------------- the parent's side
def read(path: str, pid: int | None = None) -> tuple[int, list[Entry]] | None:
    """``(job, entries)`` from a rank's ring file, oldest first; None if the file does not hold a
    ring written by ``pid`` (a rank that never attached to it)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    magic, owner, job, slots = _HEADER.unpack_from(data.ljust(_HEADER_SIZE, b"\0"), 0)
    if magic != _MAGIC or (pid is not None and owner != pid):
        return None
    texts, entries = {}, []
    for off in range(_HEADER_SIZE, min(ring_size(slots, 0), len(data) - _SLOT.size + 1), _SLOT.size):
        seq, nbytes, index, number, seq2 = _SLOT.unpack_from(data, off)
        if seq <= 0 or seq != seq2:
            continue
        if number not in texts:
            n, text = _TEXT.unpack_from(data, ring_size(slots, number)) if ring_size(slots, number + 1) <= len(data) \
                else (0, b"")
            texts[number] = (text[:n].decode(errors="replace").split("\x1f") + [""] * 5)[:5]
        op, dtype, ranks, ordinal, labels = texts[number]
        entries.append(Entry(seq, int(ordinal or 0), index, nbytes, op, dtype,
                             tuple(int(r) for r in ranks.split(",") if r), labels))
    entries.sort(key=lambda e: e.seq)
    return job, entries


_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')


def where_in(stack: str) -> tuple[str, int, str, str] | None:
    """``(file, line, function, via)`` from a stack as text (a traceback, ``format_stack``, or
    faulthandler's dump, most recent call first): the innermost frame outside torch, ddpkit and
    the standard library (else the outermost ddpkit one), and the outermost ddpkit strategy
    frame on the way (``"overlapped.py: _sync_gradients"``); None if it names no frame."""
    frames = _FRAME.findall(stack)
    if "most recent call first" not in stack:
        frames.reverse()  # innermost first
    found, via = None, ""
    for file, line, function in frames:
        kind = _classify(file)
        if kind == "worker":
            break
        if kind == "strategy":
            via = f"{os.path.basename(file)}: {function}"
        if kind != "lib" or found is None:  # outward: a ddpkit frame replaces a torch one
            found = (file, int(line), function)
        if kind == "user":
            break
    return None if found is None else (*found, via)


def blocked_in_a_wait(stack: str) -> bool:
    """Is the innermost frame of this stack waiting for a collective (a ``wait()``, or inside
    ``torch.distributed``)? What a rank asked for its stack was doing."""
    frames = _FRAME.findall(stack)
    if not frames:
        return False
    file, _, function = frames[0] if "most recent call first" in stack else frames[-1]
    return function == "wait" or os.path.join("torch", "distributed") + os.sep in file


def ring_size(slots: int = SLOTS, texts: int = TEXTS) -> int:
    """Bytes of a ring file (the parent makes each one this big); with ``texts`` < TEXTS, where that text is."""
    return _HEADER_SIZE + slots * _SLOT.size + texts * _TEXT.size


__all__ = ["Entry", "FlightRecorder", "STALL_S", "blocked_in_a_wait", "job_thread", "read", "ring_size",
           "where_in"]
