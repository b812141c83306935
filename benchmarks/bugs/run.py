"""The bug benchmark: run every case of ``cases.toml`` at each release it names, each release
in its own cached venv, and compare ``prefixflight conform``'s exit status with the expected.

    python benchmarks/bugs/run.py [--case ID]... [--engine NAME]... [--set real|mutant]
                                  [--ci] [--json FILE]

A release venv (``PREFIXFLIGHT_BUGS_CACHE``, default ``<repo>/.venv-bugs/PACKAGE-VERSION``)
holds only the engine's wheel (``pip install --no-deps``, the wheel not kept) and the light
packages the case's engine lists; a ``.pth`` file adds the peers venv's site-packages after
its own (``PREFIXFLIGHT_PEERS_VENV``, default ``<repo>/.venv-peers``, built by
``benchmarks/peers/setup.sh``), so every release shares the peers venv's torch, Hypothesis and
the rest, and another ``.pth`` imports ``_compat.py`` (an old SGLang against the peers venv's
newer transformers). This checkout's prefixflight comes first on ``PYTHONPATH``. A release
the peers venv already has runs there; a ``source = "git"`` engine's release is a commit of
this repository whose ``serve/`` root replaces this checkout's (``HEAD``: this checkout).
``--ci`` runs only the cases that name a ``ci`` release, at that release (one per engine,
at a release the peers venv has or one that builds in seconds).

Per run it records the exit status, the seconds, and for a finding how many examples (and
seconds) the machine took to hit it before shrinking; prints a table and the recall (real
bugs whose every run matched what is expected); exits 1 when any run did not. ``--json FILE``
writes the runs and recall; with a selection (``--case`` and the like) of an existing file,
its rows replace those cases' rows there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest and mypy depend on tomli there
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
ROOT = harness.ROOT


def load(path: Path = HERE / "cases.toml") -> dict[str, Any]:
    """The cases and engines, checked: every case names a known engine and set, and each
    release of a packaged engine is a version string."""
    data = tomllib.loads(path.read_text())
    engines, cases = data["engines"], data["case"]
    ids = [c["id"] for c in cases]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise SystemExit(f"run.py: duplicate case ids in {path}: {sorted(dup)}")
    for c in cases:
        if c["engine"] not in engines:
            raise SystemExit(f"run.py: case {c['id']} names unknown engine {c['engine']!r}")
        if c["set"] not in ("real", "mutant"):
            raise SystemExit(f"run.py: case {c['id']} has set {c['set']!r}, not real or mutant")
        if not c["runs"]:
            raise SystemExit(f"run.py: case {c['id']} runs at no release")
    return data


def _purelib(python: Path) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip()


class Releases:
    """Where each engine release runs: a Python and the source roots to put first."""

    def __init__(self, engines: dict[str, Any], peers: Path, cache: Path) -> None:
        self.engines = engines
        self.peers = peers
        self.cache = cache

    @property
    def peers_python(self) -> Path:
        return self.peers / "bin" / "python"

    def get(self, engine: str, release: str, log: Any) -> tuple[Path, list[Path]]:
        """(python, source roots) for ``engine`` at ``release``, building it if needed."""
        spec = self.engines[engine]
        roots = harness.source_roots()
        if spec.get("source") == "git":
            if release == "HEAD":
                return self.peers_python, roots
            old = self._commit(release, log) / "serve"  # the commit's serve root, in its place
            return self.peers_python, [old if r.name == "serve" else r for r in roots]
        if release == spec.get("peers"):
            return self.peers_python, roots
        return self._venv(spec["package"], release, spec.get("extra", []), log), roots

    def _commit(self, commit: str, log: Any) -> Path:
        out = self.cache / f"prefixflight-{commit}"
        if not (out / ".built").exists():
            log(f"taking serve/ from commit {commit}")
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            git = ["git", "-C", str(ROOT), "archive", commit, "serve"]
            archive = subprocess.run(git, capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
            (out / ".built").write_text(commit + "\n")
        return out

    def _venv(self, package: str, version: str, extra: list[str], log: Any) -> Path:
        venv = self.cache / f"{package}-{version}"
        python = venv / "bin" / "python"
        if (venv / ".built").exists():
            return python
        log(f"building {venv} ({package}=={version} --no-deps over the peers venv)")
        shutil.rmtree(venv, ignore_errors=True)
        peers = self.peers_python
        subprocess.run([peers, "-m", "venv", "--without-pip", venv], check=True)
        site = Path(_purelib(python))
        pip = [str(peers), "-m", "pip", "install", "-q", "--no-deps", "--no-cache-dir"]
        subprocess.run([*pip, "--target", str(site), f"{package}=={version}", *extra], check=True)
        (site / "zz_prefixflight_peers.pth").write_text(
            f"import site; site.addsitedir({_purelib(peers)!r})\n"
        )
        shutil.copy(HERE / "_compat.py", site / "prefixflight_bugs_compat.py")
        (site / "prefixflight_bugs_compat.pth").write_text("import prefixflight_bugs_compat\n")
        (venv / ".built").write_text(f"{package}=={version}\n")
        return python


def run_one(
    case: dict[str, Any], release: str, expected: int, releases: Releases, log: Any
) -> dict[str, Any]:
    """``prefixflight conform`` of ``case`` at ``release``: what it returned, and whether
    that is ``expected``."""
    row: dict[str, Any] = {"case": case["id"], "set": case["set"], "engine": case["engine"],
                           "release": release, "expected": expected}  # fmt: skip
    try:
        python, roots = releases.get(case["engine"], release, log)
    except subprocess.CalledProcessError as exc:
        return {**row, "exit": None, "ok": False, "error": f"build failed: {exc}"}
    examples, steps, seed = case.get("examples", 100), case.get("steps", 50), case.get("seed", 0)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(r) for r in roots)
    env.pop("HYPOTHESIS_PROFILE", None)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [str(python), "-m", "prefixflight.cli", "conform", *case["args"],
               "--examples", str(examples), "--steps", str(steps), "--seed", str(seed),
               "--json", str(report)]  # fmt: skip
        budget = case.get("budget_s", 300)
        t0 = time.perf_counter()
        try:
            done = subprocess.run(
                cmd, cwd=ROOT / case.get("cwd", "benchmarks/bugs"), env=env,
                capture_output=True, text=True, timeout=budget,
            )  # fmt: skip
            code: int | None = done.returncode
            out = done.stdout + done.stderr
        except subprocess.TimeoutExpired:
            code, out = None, f"no result within the budget of {budget} s"
        seconds = round(time.perf_counter() - t0, 1)
        checks = json.loads(report.read_text())["checks"] if report.exists() else []
    failed = [c for c in checks if not c["passed"]]
    row.update(
        exit=code,
        ok=code == expected,
        seconds=seconds,
        command="prefixflight conform "
        + " ".join(case["args"])
        + f" --examples {examples} --steps {steps} --seed {seed}",
        examples=examples,
        found_after_examples=failed[0]["found_after_examples"] if failed else None,
        found_after_seconds=failed[0]["found_after_seconds"] if failed else None,
        message=failed[0]["message"] if failed else None,
    )
    if code not in (0, 1):
        row["error"] = out.strip()[-2000:]
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    head = f"{'case':44} {'release':8} {'want':>4} {'got':>4} {'s':>6} {'found after':>12}"
    lines = [head, "-" * len(head)]
    for r in rows:
        after = f"{r['found_after_examples']} ex" if r.get("found_after_examples") else ""
        got = "-" if r.get("exit") is None else str(r["exit"])
        mark = "" if r["ok"] else "  MISMATCH"
        lines.append(f"{r['case']:44} {r['release']:8} {r['expected']:>4} {got:>4} "
                     f"{r.get('seconds', 0):>6} {after:>12}{mark}")  # fmt: skip
    return "\n".join(lines)


def recall(cases: list[dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per set: bugs whose buggy runs all exited 1 (detected), and those whose every run
    matched (buggy found and fixed passing)."""
    out: dict[str, Any] = {}
    for name in ("real", "mutant"):
        ids = [c["id"] for c in cases if c["set"] == name]
        ran = [i for i in ids if any(r["case"] == i for r in rows)]
        found = [
            i
            for i in ran
            if all(r["exit"] == 1 for r in rows if r["case"] == i and r["expected"] == 1)
        ]
        exact = [i for i in ran if all(r["ok"] for r in rows if r["case"] == i)]  # fmt: skip
        if ran:
            out[name] = {"bugs": len(ran), "found": len(found), "all_runs_as_expected": len(exact),
                         "recall": round(len(found) / len(ran), 3),
                         "missed": sorted(set(ran) - set(found))}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--case", action="append", metavar="ID", help="only this case (repeatable)")
    ap.add_argument("--engine", action="append", metavar="NAME", help="only this engine's")
    ap.add_argument("--set", choices=("real", "mutant"), help="only this set")
    ap.add_argument(
        "--ci",
        action="store_true",
        help="only the cases with a `ci` release, at that release (CI's runs)",
    )
    ap.add_argument("--json", type=Path, metavar="FILE", help="write the results here")
    args = ap.parse_args(argv)
    data = load()
    cases = [c for c in data["case"]
             if (not args.ci or "ci" in c)
             and (not args.case or c["id"] in args.case)
             and (not args.engine or c["engine"] in args.engine)
             and (not args.set or c["set"] == args.set)]  # fmt: skip
    if args.case and len(cases) != len(set(args.case)):
        known = {c["id"] for c in data["case"]}
        ap.error(f"unknown case(s): {sorted(set(args.case) - known)}")
    peers = Path(os.environ.get("PREFIXFLIGHT_PEERS_VENV", ROOT / ".venv-peers"))
    if not (peers / "bin" / "python").exists():
        ap.error(f"no peers venv at {peers}: run benchmarks/peers/setup.sh {peers}")
    cache = Path(os.environ.get("PREFIXFLIGHT_BUGS_CACHE", ROOT / ".venv-bugs"))
    releases = Releases(data["engines"], peers, cache)

    def log(msg: str) -> None:
        print(f"run.py: {msg}", file=sys.stderr, flush=True)

    order = {(c["id"], rel): i for i, (c, rel) in
             enumerate((c, rel) for c in data["case"] for rel in c["runs"])}  # fmt: skip
    rows = []
    for case in cases:
        for release, expected in case["runs"].items():
            if args.ci and release != case["ci"]:
                continue
            log(f"{case['id']} at {case['engine']} {release}")
            rows.append(run_one(case, release, expected, releases, log))
            r = rows[-1]
            log(f"  exit {r.get('exit')} (expected {expected}) in {r.get('seconds')} s"
                + (f": {r['error'][-300:]}" if "error" in r else ""))  # fmt: skip
    if not rows:
        ap.error("no run selected")
    print(_table(rows))
    summary = recall(cases, rows)
    for name, s in summary.items():
        print(f"{name}: {s['found']} of {s['bugs']} found (recall {s['recall']:.0%}), "
              f"{s['all_runs_as_expected']} with every run as expected; missed: "
              f"{', '.join(s['missed']) or 'none'}")  # fmt: skip
    if args.json:
        doc: dict[str, Any] = {"runs": []}
        if args.json.exists() and (args.case or args.engine or args.set or args.ci):
            doc = json.loads(args.json.read_text())  # a selection: merge into the file
        chosen = {c["id"] for c in cases}
        kept = [r for r in doc["runs"] if r["case"] not in chosen]
        doc["runs"] = sorted([*kept, *rows], key=lambda r: order[(r["case"], r["release"])])
        doc["cases"] = {
            c["id"]: {k: v for k, v in c.items() if k != "id"}
            for c in data["case"]
            if any(r["case"] == c["id"] for r in doc["runs"])
        }
        doc["recall"] = recall(data["case"], doc["runs"])
        if "command" in doc:
            doc["commands"] = [doc.pop("command")]
        doc.setdefault("commands", []).append(harness.command(argv))
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
