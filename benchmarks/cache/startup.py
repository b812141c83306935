"""Whole-process cost of ``prefixflight replay`` against a standard-library replay script.

Times, as separate processes and interleaved in rotating order, ``prefixflight replay TRACE
--capacity-blocks N`` (the installed console script) and ``benchmarks/cache/stdlib_replay.py``
(about 150 lines, standard library only) doing the same replay, plus ``python -c pass`` and
``python -c "import prefixflight.core"`` to show where the time goes. Checks that both
replays print the same numbers, prints a table of medians and the ratios (stdlib script time
/ ours: above 1 means ours is faster; the target is parity, 1.0), of the wall clock and of
each child's CPU time (user + sys: steadier than the wall clock on a loaded machine), and
writes JSON.

Every process runs with bytecode caching on (``PYTHONDONTWRITEBYTECODE`` removed from its
environment), so the untimed warm-up run writes prefixflight's ``.pyc`` files as an
installed package has them (pip compiles on install) and the standard library's already
are; with the variable set, every timed run would recompile prefixflight's sources.

    python benchmarks/cache/startup.py [--trace bundled:conversation] [--capacity 4096]
                                 [--rounds 9] [--json docs/results/startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness

HERE = Path(__file__).resolve().parent


def _bundled_path(spec: str) -> str:
    """The stdlib script takes a file path: resolve ``bundled:NAME`` the way the CLI does."""
    if not spec.startswith("bundled:"):
        return spec
    from prefixflight.cli import BUNDLED_TRACES

    name = BUNDLED_TRACES[spec.removeprefix("bundled:")]
    import prefixflight.cli

    return str(Path(prefixflight.cli.__file__).parent / "data" / name)


def prefixflight_command() -> list[str]:
    """The installed ``prefixflight`` console script beside this interpreter, as a user runs
    it; ``python -m prefixflight.cli`` (which also pays for runpy) if there is none."""
    script = Path(sys.executable).with_name("prefixflight")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "prefixflight.cli"]


def commands(trace: str, capacity: int) -> dict[str, list[str]]:
    py = sys.executable
    cap = str(capacity)
    return {
        "prefixflight replay": [*prefixflight_command(), "replay", trace,
                                "--capacity-blocks", cap],
        "stdlib_replay.py": [py, str(HERE / "stdlib_replay.py"), _bundled_path(trace),
                             "--capacity-blocks", cap],
        "python -c pass": [py, "-c", "pass"],
        "import prefixflight.core": [py, "-c", "import prefixflight.core"],
    }  # fmt: skip


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def run_once(argv: list[str]) -> tuple[float, float, bytes]:
    """Wall seconds, the child's CPU seconds (user + sys) and its stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, check=True, env=ENV)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="bundled:conversation")
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    cmds = commands(args.trace, args.capacity)
    names = list(cmds)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    outputs: dict[str, bytes] = {}
    for name in names:  # warm the page cache and the bytecode caches; not timed
        outputs[name] = run_once(cmds[name])[2]
    ours = json.loads(outputs["prefixflight replay"])
    theirs = json.loads(outputs["stdlib_replay.py"])
    if ours != theirs:
        raise SystemExit(f"the replays disagree:\n{ours}\n{theirs}")
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            wall, cpu_s, _ = run_once(cmds[name])
            seconds[name].append(wall)
            cpu[name].append(cpu_s)
    medians = {n: statistics.median(v) for n, v in seconds.items()}
    cpu_medians = {n: statistics.median(v) for n, v in cpu.items()}
    ratio = medians["stdlib_replay.py"] / medians["prefixflight replay"]
    cpu_ratio = cpu_medians["stdlib_replay.py"] / cpu_medians["prefixflight replay"]
    print(f"{'process':<26} {'median s':>9} {'min s':>7} {'max s':>7} {'CPU median s':>13}")
    for name in names:
        v = seconds[name]
        print(
            f"{name:<26} {medians[name]:>9.3f} {min(v):>7.3f} {max(v):>7.3f} "
            f"{cpu_medians[name]:>13.3f}"
        )
    print(
        f"stdlib script time / prefixflight replay time: {ratio:.2f}x wall, "
        f"{cpu_ratio:.2f}x CPU (target >= 1.0x; {args.rounds} interleaved rounds, load "
        f"average {os.getloadavg()[0]:.2f})"
    )
    if args.json:
        doc = {
            "trace": args.trace,
            "capacity_blocks": args.capacity,
            "rounds": args.rounds,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_1min_at_end": os.getloadavg()[0],
            "report": ours,
            "seconds": seconds,
            "median_seconds": medians,
            "cpu_seconds": cpu,
            "median_cpu_seconds": cpu_medians,
            "stdlib_over_ours": ratio,
            "stdlib_over_ours_cpu": cpu_ratio,
            "bytecode_cached": True,
            "commands": {n: [Path(a).name if "/" in a else a for a in c] for n, c in cmds.items()},
        }
        harness.write_json(args.json, doc)


if __name__ == "__main__":
    main()
