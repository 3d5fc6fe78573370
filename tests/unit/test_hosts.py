"""kvpager/hosts.py's loopback test, which decides where a plaintext endpoint may bind without
--insecure (kvpager/metrics_http.py check_bind, the manager's warnings)."""

from __future__ import annotations

import pytest

from kvpager.hosts import is_loopback
from kvpager.metrics_http import check_bind


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.1.2.3", "::1", "[::1]"])
def test_loopback_names_and_addresses(host):
    assert is_loopback(host)
    check_bind(host, False, False)   # plaintext allowed there


@pytest.mark.parametrize("host", ["127.example.com", "0.0.0.0", "10.0.0.1", "::", "example.com", ""])
def test_other_hosts_are_not_loopback(host):
    assert not is_loopback(host)
    with pytest.raises(ValueError, match="--insecure"):
        check_bind(host, False, False)
    check_bind(host, True, False)    # HTTPS anywhere
    check_bind(host, False, True)    # or plaintext when asked for
