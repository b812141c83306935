"""Run in the peers environment: ``prefixflight conform ENGINE`` once as shipped, then once per
``--impl broken:CLASS`` (``--adapter broken:CLASS`` for a CLASS written ``adapter:CLASS``),
all in this one process (the engine is imported once); prints one JSON list of ``{"impl",
"status", "stdout", "report"}``.

    python run_impls.py ENGINE EXAMPLES STEPS [CLASS | adapter:CLASS ...]
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

from prefixflight.cli import main


def run(engine: str, examples: str, steps: str, impl: str | None) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        adapter = impl.removeprefix("adapter:") if impl else None
        args = ["conform", "--examples", examples, "--steps", steps, "--seed", "1"]
        if adapter != impl:
            args += ["--adapter", f"broken:{adapter}"]
        else:
            args += [engine] + (["--impl", f"broken:{impl}"] if impl else [])
        args += ["--json", str(out)]
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            status = main(args)
        report = json.loads(out.read_text())
    return {"impl": impl, "status": status, "stdout": text.getvalue(), "report": report}


if __name__ == "__main__":
    engine, examples, steps, *classes = sys.argv[1:]
    results = [run(engine, examples, steps, impl) for impl in [None, *classes]]
    sys.stdout.write(json.dumps(results) + "\n")
