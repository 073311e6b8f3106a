"""The kvd daemon: startup builds everything it serves, then the loop serves it.

    kvd/server/startup.py   flock, signals, journal, segment (recovered or clean), pool and
                            Service, socket (0600 in a 0700 directory), pidfile, metrics: one
                            `Started`, every piece built, with the stack that releases them
    kvd/server/recovery.py  whether a crashed daemon's segment and journal may be served again
    kvd/server/loop.py      `Server`: the selector loop, sessions, group commit, replies; it
                            releases what startup built when it stops
    kvd/server/service.py   the request handlers, over the pool and the page table (no I/O)

`launch(config)` is what `kvd start` runs: startup, then a Server of what it built. `Daemon` is
the same in two steps, flags then `start()`, for a daemon run inside another program that times
or drives its start (bench/recovery.py, bench/request_path.py).
"""

from __future__ import annotations

from kvd.geometry import Geometry
from kvd.runtime import DaemonPaths
from kvd.server.loop import Server
from kvd.server import startup
from kvd.server.startup import DaemonConfig, is_running, take_lock

__all__ = ["Daemon", "DaemonConfig", "Server", "is_running", "launch", "take_lock"]


def launch(config: DaemonConfig) -> Server:
    """Start a daemon (kvd/server/startup.py) and return its Server, ready to serve_forever()."""
    return Server(startup.start(config))


class Daemon(Server):
    """A Server from a daemon's flags, in two steps: `Daemon(...)`, then `start()`.

    Until `start()` it holds only its `config` (no Server attribute exists, none is None); after
    it, it is exactly a Server.
    """

    def __init__(self, paths: DaemonPaths, geometry: Geometry, policy: str = "default",
                 metrics_port: int | None = None, state_dir: str | None = None,
                 recover: bool = False, journal: bool = True, tiers: str | None = None) -> None:
        """Args: as DaemonConfig's (a bad metrics port raises BadArgsError here)."""
        self.config = DaemonConfig(paths, geometry, policy, tiers, metrics_port, state_dir,
                                   recover, journal)

    def start(self) -> None:
        Server.__init__(self, startup.start(self.config))

    @property
    def state_dir(self) -> str:
        """Where the journal lives (or would)."""
        return self.config.journal_dir

    @property
    def num_restored(self) -> int:
        """Blocks the recovery restored (0: started clean)."""
        return self.started.num_restored
