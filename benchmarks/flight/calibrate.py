"""Fit the simulator's cost model to step times measured with prefixflight's runner (torch extra).

The same run as ``prefixflight bench calibrate``: SmolLM2-135M-Instruct, cold prefills of
several lengths, a 20-token suffix over 480 reused tokens, decode steps at batch 1, 2, 4 and
8 over ~500 cached tokens; cases interleaved, medians of the repetitions; prints the fitted
`CostModel` parameters, measured vs predicted step times, and writes JSON.

    python benchmarks/flight/calibrate.py [--repetitions 5] [--threads 2] [--device auto|cpu|cuda]
                                   [--prefill-lengths 16,64,128,256,384,500]
                                   [--decode-batches 1,2,4,8] [--json out/calibrate.json]
"""

from __future__ import annotations

import sys

from prefixflight.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "calibrate", *sys.argv[1:]]))
