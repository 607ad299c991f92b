"""A correct ``secagg simulate`` run prints no traceback: a dropped client closes its MQTT
socket while aiomqtt's queued ``add_writer`` for it is pending (seen at 1,000 clients with
SecAgg+ and 10 % drops); the worker loop says that in a debug line and passes every other
error to asyncio's default handler."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from transport.workers import _closed_socket_writes


def _run(callback_error: bool, caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_closed_socket_writes)
        a, b = socket.socketpair()
        fd = a.fileno()
        a.close()
        b.close()
        if callback_error:
            loop.call_soon(lambda: 1 / 0)
        else:
            loop.call_soon(loop.add_writer, fd, lambda: None)  # the socket is gone by now
        await asyncio.sleep(0.05)

    caplog.set_level(logging.DEBUG)
    asyncio.run(scenario())
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_write_queued_for_a_closed_socket_is_not_a_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    assert _run(False, caplog) == []
    assert any("closed client socket" in r.getMessage() for r in caplog.records)


def test_other_loop_errors_still_reach_the_default_handler(
        caplog: pytest.LogCaptureFixture) -> None:
    errors = _run(True, caplog)
    assert errors and errors[0].exc_info is not None
