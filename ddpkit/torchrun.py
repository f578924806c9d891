"""ddpkit inside your own script started by torchrun: its process group, and a recording on disk.

    import ddpkit
    ddpkit.init_process_group("gloo")           # instead of torch.distributed.init_process_group("gloo")
    model = ddpkit.OverlappedDDP(model)         # where the script built DistributedDataParallel(model)
    with ddpkit.record("run1"):                 # every rank writes run1/rank<r>.records when the block ends
        for step in ...: ...                    # the script's own loop, unchanged

    python -m ddpkit draw run1                  # the widget's pictures and a Perfetto trace, from the files

``init_process_group`` puts ddpkit's process group between torch and the real backend, so every
collective is counted and can be recorded (``network=``: emulated). ``record`` makes a
``ddpkit.trace.Recorder`` the rank's recorder inside the block, clocks aligned to rank 0's.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import glob
import os
import tempfile

import torch
import torch.distributed as dist

from ddpkit import rankside
from ddpkit.cluster import TIMEOUT_S
from ddpkit.trace.records import Record, _values
from ddpkit.trace.seam import recording

SUFFIX = ".records"


def init_process_group(backend: str = "gloo", network="loopback", **kwargs) -> None:
    """``torch.distributed.init_process_group(backend, **kwargs)`` through ddpkit's process group.
    ``timeout`` defaults to a Cluster's 60 s, not torch's 30 minutes. ``backend``: "gloo" or "nccl"
    (a NCCL rank uses GPU ``LOCAL_RANK``). ``network``: an emulated link; the default adds no time."""
    from ddpkit.comm import process_group

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl' (the real backend under ddpkit's), got {backend!r}")
    if backend == "nccl":
        rankside.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    process_group.install(network, backend)
    kwargs.setdefault("timeout", datetime.timedelta(seconds=TIMEOUT_S))
    dist.init_process_group(process_group.BACKEND_NAME, **kwargs)
    # Wrappers and process groups left in reference cycles after destroy_process_group() would
    # otherwise die in the interpreter's teardown, where a gloo backend's threads are not joined
    # cleanly: the rank then aborts ("terminate called without an active exception") after the
    # script finished. Collected at exit, while the interpreter is still whole, they die cleanly.
    atexit.unregister(gc.collect)  # once, however often the script initialises
    atexit.register(gc.collect)


@contextlib.contextmanager
def record(folder: str):
    """Record this rank inside the block; at its end write ``folder/rank<r>.records`` (atomically).
    Every rank enters it (aligning the clocks is a collective); the folder is checked first."""
    from ddpkit.trace import Recorder

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ddpkit.record needs the process group: call ddpkit.init_process_group() first")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder) as f:  # room for a step's records, 1 MiB at most
            f.write(bytes(1 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise OSError(f"ddpkit.record cannot write its records in {folder!r}: {exc.strerror or exc}") from None
    rec = Recorder()
    rec.align_clocks()
    with recording(rec):
        yield rec
    path = os.path.join(folder, f"rank{rec.rank}{SUFFIX}")
    try:  # plain data only (a Record's values), so that load can refuse anything else
        torch.save({"world_size": rec.world_size, "backend": rec.backend,
                    "records": [list(_values(r)) for r in rec.records]}, path + ".tmp")
        os.replace(path + ".tmp", path)
    except (OSError, RuntimeError) as exc:  # torch's writer raises RuntimeError ("enforce fail")
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        raise OSError(f"ddpkit.record could not write {path}: {str(exc).splitlines()[0]}") from None


def load(folder: str):
    """The ranks' files in ``folder`` merged into one ``ddpkit.trace.Trace`` (read with
    ``weights_only=True``: nothing in them can run code; a bad file is a ValueError naming it)."""
    from ddpkit.trace import Trace

    paths = sorted(glob.glob(os.path.join(folder, f"rank*{SUFFIX}")))
    if not paths:
        raise FileNotFoundError(f"no rank*{SUFFIX} files in {folder!r}: record with `with ddpkit.record({folder!r}):`")
    parts = []
    for p in paths:
        try:
            part = torch.load(p, weights_only=True)
            parts.append((int(part["world_size"]), str(part["backend"]), [Record(*r) for r in part["records"]]))
        except Exception as exc:  # noqa: BLE001 - whatever the file holds, the answer is one line naming it
            msg = str(exc).split(". ")[0][:120]
            why = ("it holds more than plain data and tensors, so it was not opened" if "Weights only" in msg
                   else f"{type(exc).__name__}: {msg}" if msg else "empty or cut short")
            raise ValueError(f"{p}: not a recording that ddpkit.record wrote, or a damaged one ({why})") from None
    world = parts[0][0]
    if len(parts) != world:
        raise ValueError(f"{folder!r} holds {len(parts)} ranks' records of a {world}-rank run: "
                         "a rank's file is missing")
    return Trace.merge([p[2] for p in parts], world_size=world, backend=parts[0][1])


def draw(folder: str, step: int = -1) -> dict[str, str]:
    """From the recording in ``folder``: ``trace.json``, ``timeline.png`` and ``bucket_fill.png`` of
    ``step`` (default the last); returns {what: path}."""
    from ddpkit.trace import to_chrome_trace
    from ddpkit.viz import plot_bucket_fill, plot_timeline

    trace = load(folder)
    if not trace.steps:
        raise ValueError(f"the recording in {folder!r} has no training step ({len(trace.records)} records): a step "
                         "begins at each training forward of a ddpkit wrapper built inside `with ddpkit.record(...)`; "
                         "one built before the block records nothing, and torch's own DistributedDataParallel and "
                         "fully_shard only their collectives")
    try:
        step = trace.resolve_step(step)
    except IndexError as exc:
        raise ValueError(str(exc)) from None
    paths = {"trace": os.path.join(folder, "trace.json"), "timeline": os.path.join(folder, "timeline.png"),
             "bucket fill": os.path.join(folder, "bucket_fill.png")}
    to_chrome_trace(trace, path=paths["trace"])
    plot_timeline(trace, steps=[step]).savefig(paths["timeline"], dpi=110)
    plot_bucket_fill(trace, rank=trace.ranks[0], step=step).savefig(paths["bucket fill"], dpi=110)
    return paths
