#!/usr/bin/env bash
# Create a separate virtual environment with the performance peers (docs/performance.md):
# vLLM 0.33.0 (v1 KV cache manager), SGLang 0.5.23 (RadixCache) and libCacheSim 0.3.5, and
# NVIDIA Dynamo's KV router index (ai-dynamo-runtime 1.6.1, a CPU wheel: its RadixTree).
#
# The peers never enter the project's own environment: vLLM and SGLang pin a GPU stack,
# and libCacheSim is GPL-licensed, so it is imported only by benchmarks/peers/run.py
# running inside this environment, never by the prefixflight package.
#
# Usage: bash benchmarks/peers/setup.sh [VENV_DIR]   (default: .venv-peers)
# Then:  .venv-peers/bin/python benchmarks/peers/run.py
#        .venv-peers/bin/prefixflight conform vllm      (or sglang, libcachesim, dynamo)
# Reuses VENV_DIR when it already has the three engines at their versions (a cached venv),
# pointing its prefixflight at this checkout and adding Dynamo if it lacks it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-$ROOT/.venv-peers}"
DL="$VENV/downloads"

# Dynamo's wheel without its dependency pins: its RadixTree (dynamo.llm) imports with
# pydantic alone (uvloop and the rest serve its runtime, which the index does not start).
install_dynamo() {
  "$VENV/bin/python" -m pip install -q --no-deps "ai-dynamo-runtime==1.6.1"
  "$VENV/bin/python" -m pip install -q pydantic
}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
want = {"vllm": "0.33.0", "sglang": "0.5.23", "libcachesim": "0.3.5"}
sys.exit(0 if all(version(p) == v for p, v in want.items()) and version("hypothesis") else 1)
PY
then
  "$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT"  # this checkout's prefixflight
  if ! "$VENV/bin/python" - <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if version("ai-dynamo-runtime") == "1.6.1" else 1)
PY
  then
    echo "setup.sh: adding ai-dynamo-runtime 1.6.1 to $VENV"
    install_dynamo
  fi
  echo "setup.sh: $VENV already has vllm 0.33.0, sglang 0.5.23, libcachesim 0.3.5, ai-dynamo-runtime 1.6.1"
  exit 0
fi

python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip

# 1. The CPU torch wheel first; anything later that asks for torch is satisfied by it.
#    Never let pip resolve torch itself: an unpinned resolve pulls the CUDA wheels (+4 GB).
"${PIP[@]}" install -q "torch==2.13.0"

# 2. prefixflight itself (ours is measured in the same process as the peers), with the specs
#    extra (Hypothesis) that `prefixflight conform` runs its machines on.
"${PIP[@]}" install -q -e "$ROOT[cli,specs]" numpy

# 3. vLLM: the wheel without its dependency pins, then the light modules its
#    KV cache manager imports (found by iterating on ModuleNotFoundError).
mkdir -p "$DL"
"${PIP[@]}" download -q --no-deps "vllm==0.33.0" -d "$DL"
"${PIP[@]}" install -q --no-deps "$DL"/vllm-0.33.0-*.whl
"${PIP[@]}" install -q "torch==2.13.0" regex cachetools psutil numpy requests tqdm blake3 \
  py-cpuinfo pydantic msgspec pyzmq cbor2 xxhash pyyaml cloudpickle typing_extensions \
  filelock prometheus_client pybase64 "transformers>=5.16.1,<5.21" aiohttp oss-harmony \
  openai pillow uvloop xgrammar "fastapi[standard]" partial_json_parser llguidance \
  || echo "setup.sh: some vLLM light dependencies failed to install; run.py will skip vLLM if it cannot import"

# 4. SGLang: likewise without deps, plus what RadixCache's import chain needs.
#    torchvision is NOT installed (the PyPI wheel is a CUDA build); run.py stubs it.
"${PIP[@]}" install -q --no-deps "sglang==0.5.23"
"${PIP[@]}" install -q "torch==2.13.0" orjson IPython dill sentencepiece compressed_tensors gguf \
  || echo "setup.sh: some SGLang dependencies failed to install; run.py will skip SGLang if it cannot import"
"${PIP[@]}" install -q --no-deps triton \
  || echo "setup.sh: triton failed to install; run.py will skip SGLang if it cannot import"

# 5. libCacheSim's Python bindings (GPL; only ever imported inside this environment).
"${PIP[@]}" install -q "torch==2.13.0" libcachesim==0.3.5

# 6. NVIDIA Dynamo's KV router index.
install_dynamo

rm -rf "$DL"
"$VENV/bin/python" - <<'PY'
import importlib
for name in ("vllm.v1.core.kv_cache_manager", "libcachesim", "dynamo.llm"):
    try:
        importlib.import_module(name)
        print(f"setup.sh: {name} imports")
    except Exception as exc:  # report, never fail: run.py skips what does not import
        print(f"setup.sh: {name} does not import: {type(exc).__name__}: {exc}")
PY
echo "setup.sh: done; run: $VENV/bin/python benchmarks/peers/run.py"
