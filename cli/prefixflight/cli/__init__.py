"""prefixflight's shell: files, the command line, progress bars and plots.

It imports the pure core and is never imported by it.
"""

from ._io import BUNDLED_TRACES, bundled_trace, open_trace, read_trace
from ._main import main

__all__ = ["BUNDLED_TRACES", "bundled_trace", "main", "open_trace", "read_trace"]
