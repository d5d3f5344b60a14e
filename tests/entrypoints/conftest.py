"""Fixtures shared by the server tests of this folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helpers.processes import SESSION_PIDS
from helpers.server import TOOL_SERVER_ARGS, RemoteServer


@pytest.fixture(scope="session")
def tool_server() -> Iterator[RemoteServer]:
    """One server with the tool template and the hermes parser, for the tool-calling and Responses
    tests; every KV block is free when it stops."""
    with RemoteServer(TOOL_SERVER_ARGS) as srv:
        SESSION_PIDS.add(srv.pid)
        try:
            yield srv
            srv.wait_idle()
        finally:
            SESSION_PIDS.discard(srv.pid)
