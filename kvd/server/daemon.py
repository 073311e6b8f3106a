"""The kvd daemon: startup builds everything it serves, then the loop serves it.

    kvd/server/startup.py   flock, signals, journal, segment (recovered or clean), pool and
                            Service, socket (0600 in a 0700 directory), pidfile, metrics: one
                            `Started`, every piece built, with the stack that releases them
    kvd/server/recovery.py  whether a crashed daemon's segment and journal may be served again
    kvd/server/loop.py      `Server`: the selector loop, sessions, group commit, replies; it
                            releases what startup built when it stops
    kvd/server/service.py   the request handlers, over the pool and the page table (no I/O)

`launch(config)` is what `kvd start` runs, and what a program does that runs a daemon inside
itself (bench/recovery.py, bench/request_path.py): startup, then a Server of what it built.
"""

from __future__ import annotations

from kvd.server.loop import Server
from kvd.server import startup
from kvd.server.service import Limits
from kvd.server.startup import DaemonConfig, is_running, take_lock

__all__ = ["DaemonConfig", "Limits", "Server", "is_running", "launch", "take_lock"]


def launch(config: DaemonConfig) -> Server:
    """Start a daemon (kvd/server/startup.py) and return its Server, ready to serve_forever()."""
    return Server(startup.start(config))
