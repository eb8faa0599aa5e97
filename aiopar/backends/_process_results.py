"""Where the process backend's manager thread unpickles a result: at once,
or on a thread of its own.

A pickle may run any code as it loads (a class's ``__setstate__``, a
reducer's callable), for as long as that code likes. The manager thread
reads every worker's frames, so it loads only a pickle that calls no code:
a small one of plain data (numbers, strings, bytes, lists, dicts, tuples),
which costs time in proportion to its few bytes. Any other result is
loaded, and its future settled, by an :class:`Unpicklers` thread; a thread
busy with one result never holds up another, which gets a thread of its own.
"""

from __future__ import annotations

import pickletools
import queue
import threading
from collections.abc import Callable

from .._waiter import Waiter, set_waiter

__all__ = ["QUICK_PICKLE", "Unpicklers", "calls_no_code"]

#: the largest pickle the manager thread loads itself
QUICK_PICKLE = 4096
# A pickle reaches code through a global, which protocol 5 names with
# STACK_GLOBAL (0x93) or through the extension registry (EXT1, EXT2, EXT4:
# 0x82 to 0x84). These bytes may also be part of some data: then a short
# pickle has its opcodes read, and a longer one takes the longer way.
#: the longest pickle whose opcodes are read when its bytes cannot tell
EXACT_SCAN = 256
# Opcodes that reach code or an object's methods: a global (and what only a
# global can give: a class to instantiate, a callable to reduce with), an
# extension-registry entry, a persistent id.
_CODE_OPCODES = frozenset("c\x93i\x82\x83\x84PQRbo\x81\x92")
# How long a thread with nothing to do waits for more before it exits.
IDLE_EXIT = 1.0

Work = Callable[[], None]


def calls_no_code(payload: bytes | bytearray | memoryview) -> bool:
    """Whether unpickling ``payload`` is quick for certain: it is small and
    names no global, so loading it runs nothing but the unpickler."""
    if len(payload) > QUICK_PICKLE:
        return False
    data = bytes(payload) if isinstance(payload, memoryview) else payload
    if b"\x93" not in data and b"\x82" not in data and b"\x83" not in data and b"\x84" not in data:
        return True
    # One of those bytes may be data (a float's or an int's: one result in
    # eleven of random floats has one): a short pickle's opcodes are read,
    # a few microseconds, where handing it to a thread costs a wake-up.
    if len(data) > EXACT_SCAN:
        return False
    try:
        return not any(op.code in _CODE_OPCODES for op, _, _ in pickletools.genops(data))
    except Exception:  # not a pickle: loading it raises, which a thread reports as well
        return False


class Unpicklers:
    """Threads that each run one piece of work at a time, a new thread
    started whenever every one is busy; an idle one exits after a while.

    ``on_idle`` is called, from the thread that finished it, when the last
    piece of work in progress is done. ``stop`` lets every thread go once
    the work in progress is done; :meth:`join` waits for them. Each thread
    has ``owner`` as its waiter (see :mod:`aiopar._waiter`): it runs
    done-callbacks of the pool's futures, so it is one of the threads that
    run aiopar's tasks.
    """

    def __init__(self, name: str, on_idle: Callable[[], None], owner: Waiter) -> None:
        self._name = name
        self._on_idle = on_idle
        self._owner = owner
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Work | None]] = []  # one per idle thread
        self._threads: list[threading.Thread] = []
        self._count = 0  # pieces of work handed out and not yet done
        self._stopped = False

    @property
    def busy(self) -> bool:
        """Whether work is in progress."""
        return self._count > 0

    def serving(self) -> bool:
        """Whether the calling thread is one of these."""
        return threading.current_thread() in self._threads

    def run(self, work: Work) -> bool:
        """Run ``work`` on an idle thread, or on a new one if none is idle;
        False if no thread could be started (as while the interpreter
        finalizes), and then the caller is to run it."""
        with self._lock:
            self._count += 1
            if self._idle:
                self._idle.pop().put(work)
                return True
            # Handed over through its inbox, not as an argument, which the
            # thread would keep (and the result with it) for as long as it lives.
            inbox: queue.SimpleQueue[Work | None] = queue.SimpleQueue()
            inbox.put(work)
            thread = threading.Thread(
                target=self._serve,
                args=(inbox,),
                name=f"{self._name}-unpickler",
                daemon=True,
            )
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        try:
            thread.start()
        except RuntimeError:
            with self._lock:
                self._count -= 1
                self._threads.remove(thread)
            return False
        return True

    def _serve(self, inbox: queue.SimpleQueue[Work | None]) -> None:
        set_waiter(self._owner)
        work = inbox.get()
        while work is not None:
            work()
            del work  # the result it settled is the future's now
            with self._lock:
                self._count -= 1
                idle = not self._count
                stopped = self._stopped
                if not stopped:
                    self._idle.append(inbox)
            if idle:
                self._on_idle()
            if stopped:
                return
            work = self._next(inbox)

    def _next(self, inbox: queue.SimpleQueue[Work | None]) -> Work | None:
        """The next piece of work handed to this idle thread; None to exit."""
        try:
            return inbox.get(timeout=IDLE_EXIT)
        except queue.Empty:
            with self._lock:
                if inbox in self._idle:
                    self._idle.remove(inbox)
                    return None
            return inbox.get()  # handed some as the wait ran out

    def stop(self) -> None:
        """Let every thread go once it has nothing to do."""
        with self._lock:
            self._stopped = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)

    def join(self) -> None:
        """Wait for the threads that :meth:`stop` let go."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()
