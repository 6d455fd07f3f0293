"""Small address helpers shared by the fellow and the leader."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit


def outbound_ip(leader_url: str) -> str:
    """The local address this machine uses to reach the leader: the fellow's LAN address for direct links.

    A connected UDP socket picks the route without sending a packet.
    """
    host = urlsplit(leader_url).hostname or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
