"""The suite's own helpers for real processes (``tests.procs``)."""

from __future__ import annotations

import socket

from tests import procs


def test_free_ports_are_free_and_never_handed_out_twice(monkeypatch):
    # the kernel picking the same port for two binds in a row, as it did in a CI run
    picks = iter([41000, 41000, 41001])
    real_socket = socket.socket

    class Repeating(real_socket):
        def getsockname(self):
            return ("127.0.0.1", next(picks))

    monkeypatch.setattr(procs, "_HANDED_OUT", set())
    monkeypatch.setattr(procs.socket, "socket", Repeating)
    assert (procs.free_port(), procs.free_port()) == (41000, 41001)
    monkeypatch.undo()
    port = procs.free_port()
    with real_socket() as s:
        s.bind(("127.0.0.1", port))  # free indeed
