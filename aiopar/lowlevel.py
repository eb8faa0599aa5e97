"""The toolkit for writing backends and rpc agents (as ``trio.lowlevel`` is trio's).

Application code never needs these names; a plugin distribution uses them
to behave as aiopar's own backends do:

* the **waiter protocol**: a thread that runs tasks registers an owner
  (:class:`Waiter`) that is told when the thread blocks in ``wait`` and
  resumes, so a pool can compensate for a blocked worker;
* the **callback runner**: a thread that must never block (one that reads
  replies off a connection) hands the callbacks of the futures it settles
  to another thread;
* **segments**: pooled shared memory that carries large arrays between
  processes without a pickle copy;
* **fresh interpreters**: a child Python that sees the parent's flags and
  ``sys.path`` and exits with its parent;
* **exit hooks**: work that must happen at interpreter exit once every
  backend has run what was queued;
* argument checks that word their errors as aiopar's own calls do;
* **info lines**: what a plugin (or ``aiopar.nn``) adds to
  :func:`aiopar.parallel_info`'s report.
"""

from __future__ import annotations

from ._callbacks import set_callback_runner
from ._checks import check_count
from ._fresh import fresh_python
from ._info import add_info_lines
from ._shm import HAVE_MEMFD, Segment, SegmentPool, aligned, map_segment
from ._waiter import Waiter, get_waiter, set_waiter
from .backends._exit import at_exit

__all__ = [
    "HAVE_MEMFD",
    "Segment",
    "SegmentPool",
    "Waiter",
    "add_info_lines",
    "aligned",
    "at_exit",
    "check_count",
    "fresh_python",
    "get_waiter",
    "map_segment",
    "set_callback_runner",
    "set_waiter",
]
