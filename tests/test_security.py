"""The job channel accepts only this cluster's own workers.

Anything the channel unpickles is executed in effect (pickle can call any function), so a
stranger must be refused *before* anything it sends is unpickled: loopback only, a mutual
HMAC challenge with the cluster's random key, a time limit per handshake.
"""
from __future__ import annotations

import logging
import pickle
import socket
import struct
import time

import psutil
import pytest

import ddpkit
from ddpkit.cluster import admission
from ddpkit.cluster import Cluster


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(world_size=1, backend="gloo", timeout=20.0)
    yield c
    c.shutdown()


class _CreatesFile:
    """A pickle that, if ever loaded, creates ``path`` (standing in for arbitrary code)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _wait_for_log(caplog, words: str, seconds: float = 10.0) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for rec in caplog.records:
            if rec.name == "ddpkit.cluster" and words in rec.getMessage():
                return rec.getMessage()
        time.sleep(0.02)
    raise AssertionError(f"no ddpkit.cluster log record with {words!r}: "
                         f"{[r.getMessage() for r in caplog.records]}")


def _closed_by_peer(sock: socket.socket, seconds: float = 10.0) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def test_the_parent_listens_on_loopback_only(cluster):
    host, port = cluster._workers.admission.address
    assert host == "127.0.0.1" and port > 0
    # the job channel and the rendezvous store: nothing on 0.0.0.0 or ::
    listening = [c.laddr for c in psutil.Process().net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN]
    assert (host, port) in [(a.ip, a.port) for a in listening]
    assert ("127.0.0.1", cluster._workers.store.port) in [(a.ip, a.port) for a in listening]
    ours = [a for a in listening if a.port in (port, cluster._workers.store.port)]
    assert all(a.ip == "127.0.0.1" for a in ours), ours


def test_a_client_with_a_wrong_key_is_refused_logged_and_its_payload_never_runs(cluster, caplog, tmp_path):
    caplog.set_level(logging.WARNING, logger="ddpkit.cluster")
    marker = tmp_path / "pwned"
    payload = pickle.dumps(("run", _CreatesFile(marker)))
    with socket.create_connection(cluster._workers.admission.address) as s:
        nonce = s.recv(32)
        assert len(nonce) == 32  # the parent speaks first: a challenge
        wrong = admission.mac(b"not the key" * 3, b"client", nonce)
        s.sendall(wrong + b"\0" * 32)
        try:
            s.sendall(struct.pack("!i", len(payload)) + payload)  # then tries its luck anyway
        except OSError:  # the parent may have hung up already
            pass
        assert _closed_by_peer(s)
    assert "does not know the cluster's key" in _wait_for_log(caplog, "refused")
    assert not marker.exists()
    assert cluster.run(lambda: ddpkit.rank()) == [0]


def test_a_client_with_no_key_that_just_sends_a_pickle_is_refused(cluster, caplog, tmp_path):
    caplog.set_level(logging.WARNING, logger="ddpkit.cluster")
    marker = tmp_path / "pwned"
    payload = pickle.dumps(("run", _CreatesFile(marker)))
    with socket.create_connection(cluster._workers.admission.address) as s:
        s.sendall(struct.pack("!i", len(payload)) + payload)  # multiprocessing's framing, no key
        assert _closed_by_peer(s)
    _wait_for_log(caplog, "refused")
    assert not marker.exists()
    assert cluster.run(lambda: 1) == [1]


def test_a_silent_client_stalls_neither_other_connections_nor_restart(cluster, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="ddpkit.cluster")
    monkeypatch.setattr(admission, "HANDSHAKE_TIMEOUT", 1.0)
    address = cluster._workers.admission.address
    silent = socket.create_connection(address)  # connects, then says nothing
    try:
        # Another stranger right behind it is still handled at once...
        with socket.create_connection(address) as s:
            s.recv(32)  # the nonce, answered with garbage
            s.sendall(b"\1" * 64)
            assert _closed_by_peer(s, seconds=5.0)
        _wait_for_log(caplog, "does not know the cluster's key", seconds=5.0)
        # ...and the silent one is dropped after the handshake time limit.
        assert "no valid handshake" in _wait_for_log(caplog, "no valid handshake", seconds=5.0)
        order = [m for m in (r.getMessage() for r in caplog.records) if "refused" in m]
        assert "does not know" in order[0], order  # the second stranger did not queue behind it
        assert _closed_by_peer(silent, seconds=5.0)
        # A restart (new listener, new key) is not held up by a silent client either.
        silent2 = socket.create_connection(cluster._workers.admission.address)
        cluster.restart()
        silent2.close()
        assert cluster.run(lambda: ddpkit.world_size()) == [1]
    finally:
        silent.close()
