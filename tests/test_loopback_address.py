"""Which addresses keep Ray on 127.0.0.1: a cluster of the command's own, and a loopback address
whose cluster answers there but not on the machine's own address (where Ray would connect).
Real listening sockets stand in for the head; nothing of Ray is imported."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from actors.ray_cluster import _is_loopback, _own_address, stays_on_loopback


@contextmanager
def listening(*hosts: str) -> Iterator[int]:
    """One port, listened on at each of ``hosts``."""
    socks = []
    try:
        for host in hosts:
            s = socket.socket()
            s.bind((host, socks[0].getsockname()[1] if socks else 0))
            s.listen()
            socks.append(s)
        yield socks[0].getsockname()[1]
    finally:
        for s in socks:
            s.close()


@pytest.fixture
def own() -> str:
    address = _own_address()
    if address is None or _is_loopback(address):
        pytest.skip("this machine has no address besides loopback for Ray to switch to")
    return address


def test_a_cluster_of_the_commands_own_stays_on_loopback():
    assert stays_on_loopback(None) and stays_on_loopback("local")


def test_a_head_listening_on_loopback_only_keeps_ray_there(own):
    with listening("127.0.0.1") as port:
        assert stays_on_loopback(f"127.0.0.1:{port}")
        assert stays_on_loopback(f"localhost:{port}")


def test_a_head_that_also_listens_on_the_machines_address_is_left_to_ray(own):
    with listening("127.0.0.1", own) as port:
        assert not stays_on_loopback(f"127.0.0.1:{port}")


@pytest.mark.parametrize("address", ["auto", "ray://127.0.0.1:{port}", "10.0.0.1:{port}",
                                     "127.0.0.1:not-a-port"])
def test_other_addresses_are_left_to_ray(own, address):
    with listening("127.0.0.1") as port:
        assert not stays_on_loopback(address.format(port=port))


def test_a_loopback_address_where_nothing_listens_is_left_to_the_reachability_check(own):
    with listening("127.0.0.1") as port:
        pass
    assert not stays_on_loopback(f"127.0.0.1:{port}")
