"""The daemon: startup and recovery, the loop and its group commit, the service, journal, metrics.

Layering rules (tests/test_layering.py enforces them):
  1. The server wires the core (kvd.core), the protocol (kvd.protocol) and the segment together;
     it is the only layer that opens sockets, the journal's database or the metrics endpoint.
  2. Nothing here imports kvd.client, kvd.embedded, kvd.cli or kvd.integrations: a daemon never
     depends on its clients.
"""
