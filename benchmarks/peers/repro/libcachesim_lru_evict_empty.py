"""libCacheSim: ``LRU.evict()`` on an empty cache segfaults (SIGSEGV).

``LRU_evict`` (LRU.c) takes the queue's tail without checking that there is one; from Python
the interpreter dies. ``S3FIFO.evict()`` on an empty cache returns. Expected: nothing evicted
(or an error). Checked with libcachesim 0.3.5; found by ``prefixflight conform libcachesim``'s
machine when run without the shipped adapter's guard.

    python libcachesim_lru_evict_empty.py    # exit 1: reproduced; exit 0: fixed
"""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import libcachesim, sys
cache = getattr(libcachesim, sys.argv[1])(20, hashpower=8)
req = libcachesim.Request()
req.obj_size = 1
cache.evict(req)
print("returned")
"""

crashed = False
for policy in ("S3FIFO", "LRU"):
    child = subprocess.run(
        [sys.executable, "-c", CHILD, policy], capture_output=True, text=True, check=False
    )
    if child.returncode < 0:
        crashed = crashed or policy == "LRU"
        print(f"{policy}(20).evict() on an empty cache: killed by signal {-child.returncode}")
    else:
        print(f"{policy}(20).evict() on an empty cache: {child.stdout.strip()}")
if crashed:
    print("REPRODUCED: LRU.evict() on an empty cache segfaults")
    sys.exit(1)
print("not reproduced")
