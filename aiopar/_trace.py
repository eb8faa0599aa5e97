"""The seam between the task machinery and :mod:`aiopar.profiler`.

``active`` is ``None`` unless a profiler is recording; every hook site checks
that one attribute and does nothing else when it is ``None``, so tracing off
costs one check per task. A recorder implements:

``on_fork(task) -> record | None``
    called in the forking thread; the returned record is stored on the task.
``record.on_start()`` / ``record.on_end()``
    called by the thread or process that runs the task, around the call.
``on_blocked(seconds)``
    called by a thread after it was blocked in ``wait`` for that long.
"""

from __future__ import annotations

from typing import Any

active: Any = None
