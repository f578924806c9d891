"""The ledger: every answer a learner gave, one JSON line each, beside the notebooks.

    append(path, entry)               # what a reveal does (``Ask.reveal``)
    entries = read(path)              # one learner's file, oldest first
    ledgers = read_class(paths)       # {learner: entries}, one learner per file

The tables of them are ``tables.py``; the pictures ``ddpkit.viz.plot_ledger`` and ``plot_class``.
A line that is not an entry (a hand edit, a cut-off write, a field of the wrong type, NaN) is a
ValueError naming the file and the line. Appends from several processes at once keep every line:
each is one ``write`` of a whole line to a file opened for appending.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ddpkit.predictions.question import QUANTITIES, UNITS

RIGHT_SHARE = 0.10   # "close": within 10% (numbers), the right winner within 10% ("which is faster")


@dataclass(frozen=True)
class Entry:
    """One answer, scored: the question, the prediction (None: skipped), the measurement of the
    learner's own run, the miss, and where it was measured. "Which is faster" keeps the first of its
    ``options``' speed-up over the second (> 1: the first faster), and its miss as prediction over
    measurement (1: right); a number keeps prediction minus measurement, in ``unit``."""

    question: str
    text: str
    unit: str
    kind: str                         # "number" or "faster"
    quantity: str
    state: str                        # "answered" or "skipped"
    prediction: float | None
    measurement: float
    miss: float | None
    direction_right: bool | None      # "which is faster" only: the winner named
    reference: float | None
    world_size: int | None
    network: str | None
    machine: str
    source: str                       # "typed" (the form), "code" (Ask.answer), "unattended"
    time: str
    options: tuple[str, ...] = ()     # "which is faster": the first is the one a speed-up > 1 favours

    @property
    def relative_miss(self) -> float | None:
        """The miss over the measurement (numbers; None for "which is faster" and skips)."""
        if self.miss is None or self.kind == "faster" or not self.measurement:
            return None
        return self.miss / abs(self.measurement)

    @property
    def close(self) -> bool:
        if self.miss is None:
            return False
        if self.kind == "faster":
            return bool(self.direction_right) and abs(math.log(self.miss)) <= math.log(1 + RIGHT_SHARE)
        return abs(self.relative_miss or 0.0) <= RIGHT_SHARE


def machine() -> str:
    """What the run ran on, in a few words: the OS, the CPU's cores, a GPU's name."""
    words = f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores"
    try:
        import torch

        if torch.cuda.is_available():
            words += f", {torch.cuda.get_device_name(0)}"
    except Exception:  # a machine without torch's CUDA: the CPU words are the description
        pass
    return words


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def append(path, entry: Entry) -> None:
    """Add ``entry`` as one line at the end of ``path`` (made with its folder if missing). After a
    cut-off last line (a write that died midway) it starts a fresh line, so the answer is kept whole.
    An OSError naming the path where it cannot be written (a folder, no permission)."""
    path = Path(path)
    line = (json.dumps(dataclasses.asdict(entry)) + "\n").encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        raise OSError(f"cannot keep the answer in {path}: {exc.strerror or exc}") from None
    try:
        if _ends_cut_off(path):
            line = b"\n" + line   # at worst (another process mid-write) an empty line, which read skips
        os.write(fd, line)        # one write of the whole line: appends from other processes never split it
    finally:
        os.close(fd)


def _ends_cut_off(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


FIELDS = {f.name: f for f in dataclasses.fields(Entry)}


def read(path) -> list[Entry]:
    """The entries of one ledger file, oldest first; a ValueError naming the file and line of the
    first line that is not one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no ledger at {path}")
    out = []
    for i, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            out.append(entry_of(json.loads(raw.decode("utf-8"), parse_constant=_no_constant)))
        except UnicodeDecodeError:
            raise ValueError(f"{path}, line {i}: not a ledger entry (not UTF-8 text: a binary file?)") from None
        except (json.JSONDecodeError, ValueError) as exc:
            raise ValueError(f"{path}, line {i}: not a ledger entry ({exc})") from None
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number a ledger keeps")


TYPES = {"str": (str, "text"), "float": ((int, float), "a finite number"), "int": (int, "a whole number"),
         "bool": (bool, "true or false")}
CHOICES = {"kind": ("number", "faster"), "state": ("answered", "skipped"), "quantity": QUANTITIES, "unit": tuple(UNITS)}


def entry_of(d) -> Entry:
    """A parsed line as an ``Entry``, each field checked against its annotation (and its choices);
    a ValueError naming the field that is not."""
    if not isinstance(d, dict):
        raise ValueError(f"a JSON object of {len(FIELDS)} fields, got {type(d).__name__}")
    missing, unknown = set(FIELDS) - set(d) - {"options"}, set(d) - set(FIELDS)
    if missing or unknown:
        raise ValueError("; ".join(f"{what} {', '.join(sorted(names))}" for what, names in
                                   (("missing", missing), ("unknown", unknown)) if names))
    if d.get("unit") == "%":
        raise ValueError("a percentage for which is faster: a ledger of an earlier ddpkit, which kept those as +x %")
    for name, f in FIELDS.items():
        value, (kind, what) = d.get(name, f.default), TYPES.get(f.type.split(" | ")[0], (None, ""))
        if kind is None or (value is None and f.type.endswith("None")):
            continue
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind) or \
                (kind is not str and not math.isfinite(value)):
            raise ValueError(f"{name} must be {what}{' or null' if f.type.endswith('None') else ''}, got {value!r}")
        if value not in CHOICES.get(name, (value,)) or (name == "world_size" and value < 1):
            raise ValueError(f"{name} must be {' or '.join(CHOICES.get(name, ['>= 1']))}, got {value!r}")
    options = d.get("options", [])
    if not (isinstance(options, list) and len(options) in (0, 2) and all(isinstance(o, str) for o in options)):
        raise ValueError(f"options must be a list of two names (or none), got {options!r}")
    return Entry(**{**d, "options": tuple(options)})


def latest(entries: list[Entry]) -> dict[str, Entry]:
    """Each question's last entry (an answer given again replaces the one before)."""
    return {e.question: e for e in entries}


def read_class(paths) -> dict[str, list[Entry]]:
    """``{learner: entries}`` from ledger files, each learner named by its file's name (without
    .jsonl); files of one name are told apart by as many of their folders as it takes. A file named
    twice is a ValueError."""
    paths = [Path(p) for p in paths]
    seen = {}
    for p in paths:
        same = seen.setdefault(p.resolve(), p)
        if same is not p:
            raise ValueError(f"{p} is named twice (as {same}): one learner per file")
    names = {}
    for p in paths:
        parts = p.resolve().with_suffix("").parts
        for depth in range(1, len(parts) + 1):
            name = "/".join(parts[-depth:])
            if sum("/".join(q.resolve().with_suffix("").parts[-depth:]) == name for q in paths) == 1:
                break
        names[name] = read(p)
    return names
