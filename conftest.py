"""Settings for every test suite of the repository (aiopar's and its plugins')."""

from __future__ import annotations

import signal


def pytest_configure() -> None:
    # A shell that starts a command in the background without job control
    # makes it ignore SIGINT, and child processes inherit that: the tests
    # that press Ctrl-C in a child would then see nothing happen. A handler
    # here (unlike an ignored signal) is reset to the default in every child,
    # as on a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
