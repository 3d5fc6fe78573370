"""Fixtures of the deployment tests (every module here is marked ``deploy``)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def compose_bin(unpacked_tools) -> str:
    """Debian's docker-compose, unpacked; the test is skipped, saying why, where it could not be fetched."""
    return unpacked_tools.require("docker-compose")
