"""Worker processes that use kvd through its public client API: attention decode, trace replay.

Several worker processes share a few cores, so each defaults to one BLAS thread: with threads per
process the small matmuls here ran 4-6x slower on a loaded 2-core machine (0.02 s vs 0.08-0.2 s
for a 300-token prefill). An explicit setting in the environment wins. This must run before
NumPy is first imported, hence here.
"""

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
