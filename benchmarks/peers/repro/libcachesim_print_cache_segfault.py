"""libCacheSim: ``S3FIFO.print_cache()`` segfaults (SIGSEGV) on a cache holding one object.

The binding's ``print_cache`` (``src/export_cache.cpp``) calls ``self.print_cache(&self)``
unconditionally, and ``S3FIFO_init`` (``S3FIFO.c``) never sets ``cache->print_cache``: the
call goes through a null function pointer. ``LRU.print_cache()`` works (it prints to C's
stdout and returns ``''``, as the binding captures only ``std::cout``). Expected: a
``NotImplementedError`` (or a printout). Checked with libcachesim 0.3.5.

    python libcachesim_print_cache_segfault.py    # exit 1: reproduced; exit 0: fixed
"""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import libcachesim, sys
cache = getattr(libcachesim, sys.argv[1])(20, hashpower=8)
req = libcachesim.Request()
req.obj_id, req.obj_size = 1, 1
cache.get(req)
cache.print_cache()  # prints the queue itself
"""

crashed = False
for policy in ("LRU", "S3FIFO"):
    child = subprocess.run(
        [sys.executable, "-c", CHILD, policy], capture_output=True, text=True, check=False
    )
    if child.returncode < 0:
        crashed = crashed or policy == "S3FIFO"
        print(f"{policy}(20) with one object: print_cache() killed by signal {-child.returncode}")
    else:
        print(f"{policy}(20) with one object: print_cache() printed {child.stdout.strip()!r}")
if crashed:
    print("REPRODUCED: S3FIFO.print_cache() segfaults")
    sys.exit(1)
print("not reproduced")
