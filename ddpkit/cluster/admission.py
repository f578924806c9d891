"""The job channel's door: a loopback socket that lets in only this cluster's own workers.

Whatever the channel unpickles is as good as executed, so the socket listens on loopback only, and
each connection must first pass a mutual HMAC challenge with a per-start random key (``handshake``,
in its own thread with a time limit) before anything is unpickled; then the worker says hello
(rank, generation, pid). A connection that fails is refused and logged (logger ``ddpkit.cluster``).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import socket
import threading
from multiprocessing.connection import Connection

log = logging.getLogger("ddpkit.cluster")

# Both ends of the job channel run this. Nothing is unpickled before it succeeds, so a
# process that does not know the key can connect but never get anything executed.
_NONCE = 32           # bytes of random challenge
_DIGEST = 32          # bytes of HMAC-SHA256
HANDSHAKE_TIMEOUT = 5.0  # seconds a peer gets to answer; a silent client cannot stall anyone


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection during the handshake")
        buf += chunk
    return buf


def mac(key: bytes, role: bytes, nonce: bytes) -> bytes:
    """HMAC-SHA256 of ``role + nonce`` under ``key``: a side's answer to the other's challenge."""
    return hmac.new(key, role + nonce, hashlib.sha256).digest()


def handshake(sock: socket.socket, key: bytes, server: bool) -> Connection:
    """Mutual HMAC challenge over a fresh socket; returns it as a multiprocessing Connection.

    Each side answers the other's nonce with HMAC(key, role + nonce); the role prefix stops a
    reflected challenge. ``PermissionError`` on a wrong answer, ``OSError`` on silence."""
    sock.settimeout(HANDSHAKE_TIMEOUT)
    if server:
        nonce = os.urandom(_NONCE)
        sock.sendall(nonce)
        answer, their_nonce = _recv_exact(sock, _DIGEST), _recv_exact(sock, _NONCE)
        if not hmac.compare_digest(answer, mac(key, b"client", nonce)):
            raise PermissionError("wrong key")
        sock.sendall(mac(key, b"server", their_nonce))
    else:
        nonce = _recv_exact(sock, _NONCE)
        mine = os.urandom(_NONCE)
        sock.sendall(mac(key, b"client", nonce) + mine)
        if not hmac.compare_digest(_recv_exact(sock, _DIGEST), mac(key, b"server", mine)):
            raise PermissionError("the parent did not prove it knows the key")
    sock.settimeout(None)  # from here on: blocking reads of length-prefixed pickles
    return Connection(sock.detach())


class Admission:
    """A listening socket on 127.0.0.1; admitted workers arrive on ``hellos`` as (rank, pid, conn)."""

    def __init__(self, generation: int, world_size: int):
        self.key = os.urandom(32)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))  # loopback only: nothing off this machine can reach it
        self._sock.listen(64)
        self.address = self._sock.getsockname()
        self.hellos: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        # no reference to this object or the cluster: a dropped cluster is collected, its __del__ stops the ranks
        threading.Thread(target=_accept_loop, daemon=True, name="ddpkit-accept",
                         args=(self._sock, self.key, self.hellos, generation, world_size,
                               self._stop)).start()

    def close(self) -> None:
        """Stop admitting and release the port."""
        self._stop.set()
        self._sock.close()


def _accept_loop(sock, key: bytes, hellos: queue.Queue, generation: int, world_size: int,
                 stop: threading.Event) -> None:
    # accept() with a short timeout: closing a socket does not wake a blocked accept() everywhere
    sock.settimeout(0.25)
    while not stop.is_set():
        try:
            peer, addr = sock.accept()
        except TimeoutError:  # socket.timeout is TimeoutError since Python 3.10
            continue
        except OSError:
            return  # the socket was closed: close()
        # a thread per connection: a silent client stalls only its own, for HANDSHAKE_TIMEOUT at most
        threading.Thread(target=_admit, daemon=True, name="ddpkit-handshake",
                         args=(peer, addr, key, hellos, generation, world_size)).start()


def _admit(peer, addr, key: bytes, hellos: queue.Queue, generation: int, world_size: int) -> None:
    """Handshake, then hello: a worker of this start goes on ``hellos``; anyone else is refused."""
    where = f"{addr[0]}:{addr[1]}"
    try:
        conn = handshake(peer, key, server=True)
    except PermissionError:
        log.warning("refused a connection to the cluster's job channel from %s: "
                    "it does not know the cluster's key", where)
        peer.close()
        return
    except OSError as exc:  # includes a silent client's timeout and a closed connection
        log.warning("refused a connection to the cluster's job channel from %s: no valid "
                    "handshake within %.0f s (%s)", where, HANDSHAKE_TIMEOUT, exc)
        peer.close()
        return
    try:  # authenticated: one of our workers, which now says who it is
        if not conn.poll(HANDSHAKE_TIMEOUT):
            raise TimeoutError("no hello")
        kind, rank, gen, pid = conn.recv()
        if kind != "hello" or gen != generation or not 0 <= rank < world_size:
            raise ValueError(f"unexpected hello {(kind, rank, gen)!r}")
    except Exception as exc:
        log.warning("refused a connection from %s with a bad hello: %s", where, exc)
        conn.close()
        return
    hellos.put((rank, pid, conn))
