"""The wire between rpc peers: pickles on plain sockets, read by one thread per process.

Only peers of one cluster talk on it: each connection starts with a mutual
HMAC-SHA256 handshake over the cluster's secret (``handshake``).

dask's comms would carry calls too, but a dask comm round trip costs 0.2 to
0.3 ms on a 2-core machine (tornado streams, msgpack framing, the event
loop), more than torch's whole ``rpc_sync``, and reaching the loop from the
calling thread and back costs two thread hops more. Here the calling thread
writes its call itself, as far as the socket takes it without waiting, and
the process's :class:`~.hub.Hub` reads every connection and writes what
was left over: a no-op ``rpc_sync`` between two processes takes about
0.1 ms, and a process has the same threads for one connection or a thousand.
dask still provides everything else: the peers and their addresses, TLS
(the ``ssl.SSLContext`` of a ``distributed.Security``), and the worker
thread pool that runs the calls.

It is split as distributed's comm is, one job a module:

- ``core``: the kinds of message, and :class:`ConnectionClosed`, the one
  error for a connection that is closed or broke, whatever ended it;
- ``pickling``: objects as a pickle and its out-of-band buffers;
- ``framing``: a message's layout, and the protocol that reads it back;
- ``connection``: a :class:`Connection`, sending from any thread and read by
  the hub; ``tls``: TLS over memory buffers; ``shared``: shared memory
  between peers of one machine;
- ``connecting`` and ``listening``: the caller's and the callee's side of a new
  connection; ``handshake``: how both prove they are peers;
- ``hub``: the one thread per process that waits on every socket.
"""

from .connecting import connect
from .connection import Connection, OnMessage
from .core import CALL, ERROR, VALUE, ConnectionClosed, Frames
from .framing import messages
from .handshake import new_secret
from .hub import Hub
from .listening import Listener
from .pickling import NOT_PLAIN, dumps, loads, plain

__all__ = [
    "CALL",
    "ERROR",
    "NOT_PLAIN",
    "VALUE",
    "Connection",
    "ConnectionClosed",
    "Frames",
    "Hub",
    "Listener",
    "OnMessage",
    "connect",
    "dumps",
    "loads",
    "messages",
    "new_secret",
    "plain",
]
