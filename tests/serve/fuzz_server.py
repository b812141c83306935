"""Fuzz ``prefixflight serve`` with schemathesis, against the server's own OpenAPI schema.

Starts ``prefixflight serve --model tiny`` (the random-weight Llama, one replica; ``--model
smollm2`` for the real one) on a free
loopback port, runs ``st run`` (schemathesis, from its own venv: ``--st``) once with a fixed
seed and once with a fresh seed (printed, so a failure can be rerun with ``--seed``), then
stops the server with SIGINT and checks it exits 0. schemathesis prints the reproducing
``curl`` command of every failure.

Checks: no server error, every status, content type, header and body as documented,
schema-invalid requests rejected, wrong methods answered 405 with ``Allow``. Not
``positive_data_acceptance``: a schema-valid request may still be refused for what the
schema cannot say (a prompt longer than the context, a model name that is not served,
overload), with a documented 400, 404 or 429.

    python tests/serve/fuzz_server.py --st .venv-st/bin/st --max-time 60   # CI
    python tests/serve/fuzz_server.py --st .venv-st/bin/st --model smollm2 --max-time 600 \
        --phases examples,coverage,fuzzing,stateful --seed 1   # the acceptance run
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_headers_conformance,response_schema_conformance,negative_data_rejection,"
    "unsupported_method,allow_header_conformance"
)


def _launcher() -> Any:
    """benchmarks/harness.py, whose server launcher the hostile probes use too."""
    spec = importlib.util.spec_from_file_location("harness", ROOT / "benchmarks" / "harness.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--st", required=True, help="the schemathesis command (st) to run")
    ap.add_argument(
        "--seed", type=int, action="append", help="seeds to run (default: 0 and a fresh one)"
    )
    ap.add_argument("--max-time", type=int, default=60, help="seconds per seed (default 60)")
    ap.add_argument("--max-examples", type=int, default=None, help="examples per operation")
    ap.add_argument("--phases", default="examples,coverage,fuzzing", help="schemathesis phases")
    ap.add_argument("--checks", default=CHECKS, help="schemathesis checks")
    ap.add_argument("--model", default="tiny", help="the served model (default tiny)")
    ap.add_argument("--server-flag", action="append", default=[], help="extra serve flags")
    args = ap.parse_args()
    seeds = args.seed or [0, random.SystemRandom().randrange(2**31)]
    proc, url, log = _launcher().start_serve(
        args.model, ["--max-waiting", "256", *args.server_flag], timeout=180
    )
    failed = False
    try:
        for seed in seeds:
            print(
                f"== schemathesis against {url}, seed {seed} (rerun with --seed {seed})", flush=True
            )
            cmd = [
                args.st, "run", f"{url}/openapi.json", "--checks", args.checks,
                "--phases", args.phases, "--seed", str(seed), "--max-time", str(args.max_time),
                "--workers", "2", "--request-timeout", "60", "--no-color",
                "--suppress-health-check", "too_slow,filter_too_much,data_too_large",
            ]  # fmt: skip
            if args.max_examples is not None:
                cmd += ["--max-examples", str(args.max_examples)]
            code = subprocess.call(cmd)
            if code != 0:
                print(f"schemathesis failed with seed {seed} (exit {code})", flush=True)
                failed = True
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = -9
    if code != 0 or any("Traceback" in line for line in log):
        print(f"the server exited {code}; its log:\n{''.join(log)}", flush=True)
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
