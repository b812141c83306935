"""libCacheSim: ``S3FIFO`` aborts the Python process (SIGABRT) for small cache sizes.

With the default ``small_size_ratio=0.1``, every ``cache_size`` from 1 to 9 makes the small
FIFO ``(int64_t)(cache_size * 0.1) == 0`` objects, and ``S3FIFO_init`` (S3FIFO.c) reports
"Invalid cache size configuration" through ``ERROR``, which aborts. From Python this cannot
be caught: the interpreter dies. Expected: a ``ValueError`` from the binding (or a minimum
small size of one object). Checked with libcachesim 0.3.5.

    python libcachesim_s3fifo_abort.py    # exit 1: reproduced; exit 0: fixed

Each size runs in a child process, so this script survives to report.
"""

from __future__ import annotations

import subprocess
import sys

CHILD = "import libcachesim, sys; libcachesim.S3FIFO(int(sys.argv[1]), small_size_ratio=0.1)"

aborted = []
for size in range(1, 13):
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(size)], capture_output=True, text=True, check=False
    )
    how = "ok" if child.returncode == 0 else f"died with status {child.returncode}"
    if child.returncode < 0:
        how = f"killed by signal {-child.returncode}"
        aborted.append(size)
    said = [line for line in child.stderr.splitlines() if "Invalid" in line]
    detail = said[0].split(": ", 1)[-1] if said else ""
    print(f"S3FIFO({size}, small_size_ratio=0.1): {how} {detail}".rstrip())
if aborted:
    print(f"REPRODUCED: the process aborts for cache sizes {aborted}")
    sys.exit(1)
print("not reproduced")
