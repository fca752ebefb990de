import socket

import pytest

from psserver.utils import ports


def _range_file(tmp_path, text):
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("text", "expected"), [
    ("32768\t60999\n", range(10000, 32768)),  # Linux's default: the span below is the larger
    ("12000 60999", range(61000, 65536)),      # little room below: the span above
    ("not a range", range(10000, 32768)),      # unreadable: Linux's default
])
def test_fixed_ports_avoid_the_ephemeral_range(tmp_path, text, expected):
    assert ports.fixed_ports(_range_file(tmp_path, text)) == expected


def test_a_free_port_is_outside_the_ephemeral_range_and_never_handed_out_twice():
    low, high = ports.ephemeral_range()
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == 50
    assert not any(low <= p <= high for p in picked)


def test_a_bound_port_is_never_picked():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert ports.free_port(ports=range(port, port + 1)) != port  # falls back to the kernel's pick
