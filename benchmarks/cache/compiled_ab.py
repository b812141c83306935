"""The pure-Python core against the optional compiled build (mypyc), side by side in one run.

Three measurements, each interleaved round by round (pure, compiled, ... in rotating order) so
the other work on the machine slows both alike; the table shows medians and the median of the
per-round ratios:

* policy stream: ``S3FIFO(capacity).access_stream(keys)`` over the Zipf(0.9) stream of
  benchmarks/peers (2M keys over 200k objects), capacities 4,096 and 65,536;
* engine path: benchmarks/peers' engine workload on our public API (hash, look up, pin,
  allocate, publish, release), ``--requests`` prompts;
* whole-process replay: ``prefixflight replay bundled:conversation --capacity-blocks 4096``
  as a fresh process, against a standard-library replay (this file run with
  ``--stdlib-replay``: gzip + json + a plain S3-FIFO, no prefixflight), timed as wall clock
  and as the child's CPU time (user + sys, steadier on a loaded machine). All three must
  report the same hit tokens (equal work).

Build the compiled variant first and give its import root (an unpacked wheel):

    PREFIXFLIGHT_COMPILE=1 pip wheel --no-deps --no-build-isolation -w dist/ .
    python -m zipfile -e dist/prefixflight-*-cp*.whl out/compiled
    python benchmarks/cache/compiled_ab.py --compiled out/compiled --json out/compiled_ab.json

The pure variant is this checkout's source roots (pyproject.toml's list, ``benchmarks/harness.py``).
"""

from __future__ import annotations

import sys


# -- the standard-library replay (kept first and light: it is timed as a whole process) ----
def stdlib_replay(path: str, capacity: int, block_size: int = 512) -> tuple[int, int, int]:
    """The S3-FIFO prefix-cache replay task's numbers with gzip, json and collections only:
    (requests, prompt tokens, hit tokens). The same S3FIFO (small 10%, banker's rounding;
    main with second chance; ghost as large as main; max freq 3)."""
    import gzip
    import json
    from collections import OrderedDict, deque

    small_cap = round(capacity * 0.1)
    main_cap = capacity - small_cap
    freq: dict[int, int] = {}
    small: deque[int] = deque()
    main: deque[int] = deque()
    ghost: OrderedDict[int, None] = OrderedDict()

    def to_ghost(b: int) -> None:
        if b in ghost:
            del ghost[b]
        elif len(ghost) >= main_cap:
            ghost.popitem(last=False)
        ghost[b] = None

    def to_main(b: int, f: int) -> None:
        while len(main) >= main_cap:
            v = main.popleft()
            vf = freq[v]
            if vf:
                freq[v] = vf - 1
                main.append(v)
                continue
            del freq[v]
            to_ghost(v)
            break
        main.append(b)
        freq[b] = f

    requests = prompt = hit = 0
    with gzip.open(path, "rt") as fh:
        for line in fh:
            if not line.strip():
                continue
            rec = json.loads(line)
            ids = rec["hash_ids"]
            n = rec["input_length"]
            k = 0
            for b in ids:
                if b not in freq:
                    break
                k += 1
            for b in ids:
                f = freq.get(b)
                if f is not None:
                    if f < 3:
                        freq[b] = f + 1
                    continue
                if b in ghost:
                    del ghost[b]
                    to_main(b, 0)
                    continue
                if len(small) >= small_cap:
                    v = small.popleft()
                    vf = freq[v]
                    if vf:
                        to_main(v, vf)
                    else:
                        del freq[v]
                        to_ghost(v)
                small.append(b)
                freq[b] = 0
            requests += 1
            prompt += n
            hit += min(k * block_size, n)
    return requests, prompt, hit


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--stdlib-replay":
    _r, _p, _h = stdlib_replay(sys.argv[2], int(sys.argv[3]))
    print(f'{{"total_requests": {_r}, "total_prompt_tokens": {_p}, "total_hit_tokens": {_h}}}')
    raise SystemExit(0)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness  # noqa: E402

ROOT = harness.ROOT
PURE_PATH = harness.pythonpath()


# -- the worker: one long-lived process per variant, fed tasks on stdin -------------------
def worker(requests: int, keys: int, objects: int) -> None:
    import importlib.util

    import prefixflight.core.cache as cache

    spec = importlib.util.spec_from_file_location("peers_run", ROOT / "benchmarks/peers/run.py")
    assert spec is not None and spec.loader is not None
    peers = importlib.util.module_from_spec(spec)
    sys.modules["peers_run"] = peers
    spec.loader.exec_module(peers)
    stream = peers.zipf_stream(n=keys, objects=objects)
    prompts = peers.engine_prompts(n=requests) if requests else []
    print(json.dumps({"ready": True, "compiled": cache.compiled}), flush=True)
    for line in sys.stdin:
        task = line.strip()
        if task.startswith("policy:"):
            out = peers.ours_policy(stream, int(task.split(":")[1]), "s3fifo")
        elif task == "engine":
            out = peers.ours_engine(prompts, "s3fifo")
        else:
            raise SystemExit(f"unknown task {task!r}")
        print(json.dumps({"seconds": out.seconds, "hit_rate": out.hit_rate}), flush=True)


class Worker:
    def __init__(self, path: str, args: argparse.Namespace) -> None:
        env = {**os.environ, "PYTHONPATH": path}
        cmd = [sys.executable, __file__, "--worker", "--requests", str(args.requests)]
        cmd += ["--keys", str(args.keys), "--objects", str(args.objects)]
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"worker exited with {self.proc.wait()}")
        out: dict[str, Any] = json.loads(line)
        return out

    def run(self, task: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(task + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run_process(cmd: list[str], path: str | None) -> tuple[float, float, dict[str, Any]]:
    """Wall seconds, child CPU seconds (user + sys) and the parsed JSON stdout."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # bytecode cached, as in an installed package
    if path is not None:
        env["PYTHONPATH"] = path
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(done.stdout)


def summarize(rows: dict[str, list[float]], ref: str) -> dict[str, Any]:
    rounds = len(rows[ref])
    out: dict[str, Any] = {}
    for name, times in rows.items():
        ratios = [times[i] / rows[ref][i] for i in range(rounds)]
        out[name] = {
            "median_s": statistics.median(times),
            "best_s": min(times),
            "time_over_ref": statistics.median(ratios),
            "rounds": times,
        }
    return out


def table(title: str, summary: dict[str, Any], ref: str, unit: str, count: int) -> str:
    lines = [f"#### {title}", "", f"| variant | median s | best s | us/{unit} | time / {ref} |"]
    lines.append("| --- | ---: | ---: | ---: | ---: |")
    for name, s in summary.items():
        us = s["median_s"] / count * 1e6 if count else 0.0
        lines.append(
            f"| {name} | {s['median_s']:.3f} | {s['best_s']:.3f} | {us:.3f} "
            f"| {s['time_over_ref']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--compiled", help="import root of the compiled build (an unpacked wheel)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=3000, help="engine path prompts (0: skip)")
    ap.add_argument("--keys", type=int, default=2_000_000)
    ap.add_argument("--objects", type=int, default=200_000)
    ap.add_argument("--capacities", default="4096,65536")
    ap.add_argument("--replay-capacity", type=int, default=4096)
    ap.add_argument(
        "--stdlib-script",
        default=str(ROOT / "benchmarks/cache/stdlib_replay.py"),
        help="a standard-library replay script (TRACE --capacity-blocks N) to time as well, "
        "if the file exists; the ratios are taken against it",
    )
    ap.add_argument("--skip", default="", help="comma list of policy,engine,replay to skip")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.requests, args.keys, args.objects)
        return 0
    if not args.compiled:
        ap.error("--compiled is required (see the module docstring for how to build it)")
    skip = set(filter(None, args.skip.split(",")))
    compiled_path = os.pathsep.join([str(Path(args.compiled).resolve())])
    variants = {"pure": PURE_PATH, "compiled": compiled_path}
    caps = [int(c) for c in args.capacities.split(",") if c]
    results: dict[str, Any] = {"rounds": args.rounds, "python": sys.version.split()[0]}
    report: list[str] = []

    if not {"policy", "engine"} <= skip:
        workers = {name: Worker(path, args) for name, path in variants.items()}
        if workers["pure"].hello["compiled"] or not workers["compiled"].hello["compiled"]:
            raise SystemExit(f"variants not as named: {[w.hello for w in workers.values()]}")
        tasks = [] if "policy" in skip else [f"policy:{c}" for c in caps]
        if "engine" not in skip and args.requests:
            tasks.append("engine")
        for task in tasks:
            rows: dict[str, list[float]] = {name: [] for name in variants}
            rates: dict[str, set[float]] = {name: set() for name in variants}
            for r in range(args.rounds):
                order = list(variants) if r % 2 == 0 else list(reversed(variants))
                for name in order:
                    out = workers[name].run(task)
                    rows[name].append(out["seconds"])
                    rates[name].add(out["hit_rate"])
            if len({x for v in rates.values() for x in v}) != 1:
                raise SystemExit(f"{task}: hit rates differ: {rates}")
            s = summarize(rows, "pure")
            hit_rate = rates["pure"].pop()
            if task == "engine":
                title = f"engine path: {args.requests} requests (benchmarks/peers workload)"
                key, unit, count = "engine", "request", args.requests
            else:
                cap = task.split(":")[1]
                title = f"S3FIFO access_stream: {args.keys} Zipf(0.9) keys, capacity {cap}"
                key, unit, count = f"policy_{cap}", "key", args.keys
            results[key] = {"summary": s, "hit_rate": hit_rate}
            report.append(table(title, s, "pure", unit, count))
            print(report[-1], "\n", flush=True)
        for w in workers.values():
            w.close()

    if "replay" not in skip:
        trace = ROOT / "cli/prefixflight/cli/data/conversation_trace.jsonl.gz"
        cap = str(args.replay_capacity)
        cli = [sys.executable, "-m", "prefixflight.cli", "replay", "bundled:conversation"]
        cli += ["--capacity-blocks", cap, "-q"]
        cmds: dict[str, tuple[list[str], str | None]] = {}
        ref = "stdlib minimal (this file)"
        if Path(args.stdlib_script).is_file():
            ref = "stdlib script"
            script = [sys.executable, args.stdlib_script, str(trace), "--capacity-blocks", cap]
            cmds[ref] = (script, None)
            script_path = Path(args.stdlib_script).resolve()
            is_ours = script_path.is_relative_to(ROOT)
            shown = script_path.relative_to(ROOT) if is_ours else script_path
            results["stdlib_script"] = str(shown)
        mini = [sys.executable, __file__, "--stdlib-replay", str(trace), cap]
        cmds["stdlib minimal (this file)"] = (mini, None)
        cmds["prefixflight pure"] = (cli, variants["pure"])
        cmds["prefixflight compiled"] = (cli, variants["compiled"])
        wall: dict[str, list[float]] = {name: [] for name in cmds}
        cpu: dict[str, list[float]] = {name: [] for name in cmds}
        hits: dict[str, set[int]] = {name: set() for name in cmds}
        names = list(cmds)
        for r in range(args.rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                secs, cpu_s, out = run_process(*cmds[name])
                wall[name].append(secs)
                cpu[name].append(cpu_s)
                hits[name].add(out["total_hit_tokens"])
        if len({x for v in hits.values() for x in v}) != 1:
            raise SystemExit(f"replay: hit tokens differ: {hits}")
        sw = summarize(wall, ref)
        sc = summarize(cpu, ref)
        results["replay"] = {
            "command": " ".join(cli[2:]),
            "reference": ref,
            "total_hit_tokens": hits[ref].pop(),
            "wall": sw,
            "cpu": sc,
        }
        for label, s in (("wall clock", sw), ("child CPU time (user + sys)", sc)):
            title = f"whole-process replay, bundled:conversation, capacity {cap}: {label}"
            report.append(table(title, s, ref, "process", 1))
            print(report[-1], "\n", flush=True)

    if args.json:
        harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
