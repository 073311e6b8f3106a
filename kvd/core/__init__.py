"""The pure core: block pool, prefix tree, restore, page table and eviction policies.

Layering rules (tests/test_layering.py enforces them):
  1. Nothing here does I/O: no socket, selectors, msgpack, sqlite3, posix_ipc, mmap, file or
     environment access. The core is handed numbers, ids and keys, and hands them back.
  2. Nothing here imports kvd.protocol, kvd.server, kvd.client, kvd.segment or kvd.embedded: the
     core never knows who calls it (the daemon's Service and the embedded cache both do).
  3. Allowed: the standard library's pure modules, numpy, kvd.errors, kvd.hashing and kvd.native
     (the one loader of compiled modules, which reads the environment on the core's behalf).
"""
