"""Network addresses in config: which ones never leave this machine."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1: an address that never leaves this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
