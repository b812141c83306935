"""The TTFT experiments of the single-flight prefill study of mini-vllm-rs on SmolLM2-135M,
with prefixflight's engine (torch extra).

The same run as ``prefixflight bench ttft``: warm document prefix, incremental publication,
single flight under independent / on_completion / after_prefill, and the late arrival, all
side by side in one process, strategies interleaved within each repetition, medians printed
as tables and written as JSON.

    python benchmarks/flight/ttft.py [--repetitions 3] [--output-tokens 128] [--concurrency 2,4,8]
                              [--device auto|cpu|cuda] [--threads N] [--json out/ttft.json]
"""

from __future__ import annotations

import sys

from prefixflight.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "ttft", *sys.argv[1:]]))
