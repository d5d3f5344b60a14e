"""Ports chosen for the engine's sockets lie outside the kernel's ephemeral range.

A core process connects to its front-end's port before the front-end binds it, and ZeroMQ retries
the connection; on a port of the ephemeral range such a retry can be given the destination port as
its own source port and connect to itself, after which the front-end cannot bind."""

from __future__ import annotations

import socket

import pytest

from pagedllm.utils import PORT_RANGE_ENV, ephemeral_port_range, free_port_range


def test_ports_are_outside_the_ephemeral_range_and_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
    low, high = ephemeral_port_range()
    for count in (1, 2, 4):
        for _ in range(50):
            base = free_port_range("127.0.0.1", count)
            ports = range(base, base + count)
            assert all(not low <= p <= high for p in ports), (base, count, (low, high))
            assert all(p >= 10000 for p in ports)
            for p in ports:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", p))


def test_a_taken_range_is_not_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every candidate but one taken, the one free range is found."""
    import pagedllm.utils as utils

    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    free = free_port_range("127.0.0.1", 2)
    held.bind(("127.0.0.1", free + 1))
    candidates = iter([free, free, free + 3])
    monkeypatch.setattr(utils.random, "randint", lambda lo, hi: next(candidates))
    try:
        assert free_port_range("127.0.0.1", 2) == free + 3
    finally:
        held.close()


def test_a_configured_range_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """``$PAGEDLLM_PORT_RANGE`` bounds every choice, ranges of several ports included."""
    monkeypatch.setenv(PORT_RANGE_ENV, "23000-23009")
    for count in (1, 3, 10):
        for _ in range(20):
            base = free_port_range("127.0.0.1", count)
            assert 23000 <= base and base + count - 1 <= 23009, (base, count)


@pytest.mark.parametrize("value", ["23000", "a-b", "23000-22000", "80-90", "23000-70000", "23000-23001"])
def test_a_bad_configured_range_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, value)
    with pytest.raises(ValueError, match=PORT_RANGE_ENV):
        free_port_range("127.0.0.1", 3)
