"""The rank side of a Cluster: ``python -m ddpkit._worker``, one fresh interpreter per rank.

Start-up, in order:
1. read one JSON line of configuration from stdin (rank, world size, backend, the parent's
   job address and its random key, the TCPStore port, the parent's sys.path and cwd);
2. keep reading stdin in a thread: the parent holds the other end, so end-of-file means the
   parent is gone (even after SIGKILL) and the worker exits at once (no orphans);
3. connect back to the parent over loopback, proving it knows the key (HMAC challenge by
   ``multiprocessing.connection``), and say hello;
4. join the process group through the parent's TCPStore, then report ready.
Then loop: receive a job (a function pickled by value with cloudpickle), run it, send back
the pickled result or the formatted traceback.

A worker is a whole process, so it holds a little process-wide state (``_context``): the
connection to the parent, which ``ddpkit.progress()`` uses to report from inside a job.
"""
from __future__ import annotations

import io
import json
import os
import sys
import threading
import traceback
from datetime import timedelta
from multiprocessing.connection import Client


class _Context:
    """What a running job may need from its worker: the channel back to the parent."""

    def __init__(self, conn, rank: int):
        self.conn, self.rank = conn, rank
        self.lock = threading.Lock()
        self.namespace: dict = {"__name__": "__ranks__"}  # %%ranks cells share this per rank

    def send(self, msg) -> None:
        with self.lock:
            self.conn.send(msg)


_context: _Context | None = None  # set once in main(); None outside a Cluster worker


def report(kind: str, **payload) -> None:
    """Send a side message (progress, records, ...) to the parent while a job runs."""
    if _context is not None:
        _context.send(("event", kind, payload))


class _ChannelWriter(io.TextIOBase):
    """sys.stdout/sys.stderr of a worker: each line goes to the parent over the job channel.

    Sharing the channel with results keeps order: everything a job printed reaches the parent
    before the job's result does. Output written below Python (C++ warnings to fd 1/2) still
    goes to the process's pipes, which the parent also reads.
    """

    def __init__(self, stream: str):
        self.stream, self._buf = stream, ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self._buf += s
        if "\n" in self._buf:
            *lines, self._buf = self._buf.split("\n")
            for line in lines:
                _context.send(("out", self.stream, line))
        return len(s)

    def flush(self) -> None:
        if self._buf:
            line, self._buf = self._buf, ""
            _context.send(("out", self.stream, line))


def _exit_when_parent_dies(stdin) -> None:
    while stdin.read(65536):
        pass
    os._exit(0)


def _pickle(obj) -> bytes:
    import cloudpickle

    return cloudpickle.dumps(obj)


def main() -> None:
    global _context
    stdin = sys.stdin.buffer
    cfg = json.loads(stdin.readline())
    threading.Thread(target=_exit_when_parent_dies, args=(stdin,), daemon=True).start()
    for path in reversed(cfg["sys_path"]):
        if path not in sys.path:
            sys.path.insert(0, path)
    rank, world_size = cfg["rank"], cfg["world_size"]

    conn = Client(tuple(cfg["address"]), authkey=bytes.fromhex(cfg["authkey"]))
    conn.send(("hello", rank, cfg["generation"], os.getpid()))
    _context = _Context(conn, rank)
    sys.stdout, sys.stderr = _ChannelWriter("stdout"), _ChannelWriter("stderr")

    import torch
    import torch.distributed as dist

    try:
        if cfg["backend"] == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore(cfg["store_host"], cfg["store_port"], is_master=False,
                              timeout=timedelta(seconds=cfg["timeout"]))
        dist.init_process_group(cfg["backend"], store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=cfg["timeout"]))
        device = f"cuda:{rank}" if cfg["backend"] == "nccl" else "cpu"
        conn.send(("ready", rank, {"pid": os.getpid(), "device": device}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise SystemExit(1)

    import cloudpickle

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg[0] == "stop":
            break
        if msg[0] != "run":
            continue
        try:
            fn, args, kwargs = cloudpickle.loads(msg[1])
            result = fn(*args, **kwargs)
        except BaseException as exc:  # KeyboardInterrupt too: the parent asked us to stop
            sys.stdout.flush(); sys.stderr.flush()
            conn_msg = ("error", traceback.format_exc(), type(exc).__name__)
        else:
            try:
                conn_msg = ("result", _pickle(result))
            except Exception as exc:
                conn_msg = ("error", f"the result of rank {rank} ({type(result).__name__}) cannot be "
                            f"pickled to send back: {exc}", "PicklingError")
        sys.stdout.flush(); sys.stderr.flush()
        _context.send(conn_msg)

    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)


if __name__ == "__main__":
    main()
