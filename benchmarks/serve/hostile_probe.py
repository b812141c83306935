"""Hostile probes against ``prefixflight serve``: the acceptance set of issue "a server that
survives its first fuzzer", rerunnable.

Starts ``prefixflight serve --model MODEL`` on a free loopback port (or probes ``--url``),
then runs every probe ``--rounds`` times: malformed JSON; huge, negative, NaN and vanishing
numbers; 64 concurrent streams of which half disconnect after their first event; stalled
clients (silent connections, headers that never end, bodies that stop); big bodies (over the
limit: 413; under it: tokenized off the event loop while ``/health`` is timed). After each
round it checks that the gauges are back to idle (nothing running or waiting, no request in
progress, no pinned or private page) and records the server's RSS and open file descriptors.

It fails (exit 1) on any 5xx, any probe that hangs past its timeout, gauges not idle, or
descriptors not back. It prints a JSON summary (``--json FILE`` writes it).

    python benchmarks/serve/hostile_probe.py --model smollm2 --rounds 2 \
        --json docs/results/hostile_probe.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.harness
from benchmarks import harness


def proc_stats(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:"))
    return {"rss_mib": round(rss / 1024, 1), "fds": len(os.listdir(f"/proc/{pid}/fd"))}


class Tally:
    def __init__(self) -> None:
        self.statuses: dict[str, int] = {}
        self.server_errors: list[str] = []
        self.hangs: list[str] = []

    def saw(self, what: str, status: int) -> None:
        self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
        if status >= 500:
            self.server_errors.append(f"{what}: {status}")


MALFORMED = [
    b"{not json",
    b'{"prompt": "x"',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"prompt": "x", "max_tokens": 1}' * 3,
    b"\xff\xfe\x00garbage",
    b'{"prompt": ["a", 1, [2]]}',
    b'{"messages": "hi"}',
    b'{"prompt": {"nested": {"deep": [1, 2, {"x": null}]}}}',
    b"",
    b"null",
]
NUMBERS: list[dict[str, Any]] = [
    {"max_tokens": 10**30},
    {"max_tokens": -5},
    {"max_tokens": 0},
    {"temperature": float("nan")},
    {"temperature": float("inf")},
    {"temperature": 1e-300},
    {"temperature": 5e-324},
    {"top_p": 5e-324},
    {"top_p": -1},
    {"top_k": 10**12},
    {"seed": 2**64},
    {"seed": -1},
    {"n": 10**9},
    {"n": 80},
    {"min_tokens": 10**9},
    {"stop_token_ids": [-1]},
    {"prompt": [10**12]},
    {"prompt": [-3]},
    {"prompt": [1.5]},
]


async def malformed_and_numbers(client: httpx.AsyncClient, url: str, tally: Tally) -> None:
    for raw in MALFORMED:
        r = await client.post(
            url + "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
        tally.saw("malformed", r.status_code)
    for extra in NUMBERS:
        body = {"prompt": "Say hi.", "max_tokens": 2, **extra}
        raw = json.dumps(body, allow_nan=True).encode()
        for path in ("/v1/completions",):
            r = await client.post(
                url + path, content=raw, headers={"content-type": "application/json"}
            )
            tally.saw(f"numbers {extra}", r.status_code)


async def streams_half_disconnecting(url: str, tally: Tally, n: int = 64) -> dict[str, int]:
    done = {"finished": 0, "disconnected": 0}

    async def one(i: int) -> None:
        body = {
            "prompt": f"Count from {i} upwards:",
            "max_tokens": 24,
            "stream": True,
            "ignore_eos": True,
        }
        async with (
            httpx.AsyncClient(timeout=300) as client,
            client.stream("POST", url + "/v1/completions", json=body) as r,
        ):
            tally.saw("stream", r.status_code)
            if r.status_code != 200:
                return
            async for line in r.aiter_lines():
                if i % 2 and line.startswith("data: {"):
                    done["disconnected"] += 1
                    return  # leaving the block closes the connection
                if line == "data: [DONE]":
                    done["finished"] += 1

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), timeout=600)
    return done


def stalled_clients(url: str, timeout: float, n: int = 100) -> dict[str, Any]:
    host, port = url.removeprefix("http://").split(":")
    addr = (host, int(port))
    socks = [socket.create_connection(addr) for _ in range(n)]
    for s in socks[n // 3 : 2 * n // 3]:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
    for s in socks[2 * n // 3 :]:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": "'
        )
    started = time.monotonic()
    closed = 0
    for s in socks:
        s.settimeout(max(0.1, timeout + 10 - (time.monotonic() - started)))
        try:
            while s.recv(65536):
                pass
            closed += 1
        except TimeoutError:
            pass
        except ConnectionResetError:
            closed += 1
        finally:
            s.close()
    return {
        "opened": n,
        "closed_by_server": closed,
        "seconds": round(time.monotonic() - started, 1),
    }


async def big_bodies(
    client: httpx.AsyncClient, url: str, tally: Tally, limit: int
) -> dict[str, Any]:
    # over the limit: the server answers 413 from the headers alone, reading none of the body
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {10 * limit}\r\n\r\n".encode()
        )
        s.settimeout(30)
        status = int(s.recv(65536).split(b" ", 2)[1])
    tally.saw("over the body limit", status)
    assert status == 413, status
    under = b'{"prompt": "' + b"word " * (limit // 10) + b'"}'  # half the limit
    started = time.monotonic()
    task = asyncio.ensure_future(
        client.post(
            url + "/v1/completions", content=under, headers={"content-type": "application/json"}
        )
    )
    await asyncio.sleep(0.5)  # the upload is in; it is being parsed and tokenized
    health = []
    while not task.done():
        t = time.monotonic()
        h = await client.get(url + "/health")
        health.append(time.monotonic() - t)
        tally.saw("health during a big prompt", h.status_code)
        await asyncio.sleep(0.2)
    r = await task
    tally.saw("half the body limit", r.status_code)
    return {
        "half_limit_status": r.status_code,
        "half_limit_seconds": round(time.monotonic() - started, 1),
        "health_max_ms_meanwhile": round(1000 * max(health, default=0.0), 1),
        "health_probes_meanwhile": len(health),
    }


def idle(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "prefixflight:requests_in_progress",
            ):
                out[s.name] = s.value
            elif s.name == "prefixflight:kv_pages" and s.labels["state"] in ("pinned", "private"):
                out[f"kv_pages_{s.labels['state']}"] = s.value
    return out


async def round_(url: str, args: argparse.Namespace, tally: Tally) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=300) as client:
        t = time.monotonic()
        await asyncio.wait_for(malformed_and_numbers(client, url, tally), timeout=600)
        out["malformed_and_numbers_s"] = round(time.monotonic() - t, 1)
        t = time.monotonic()
        out["streams"] = await streams_half_disconnecting(url, tally)
        out["streams_s"] = round(time.monotonic() - t, 1)
        out["big_bodies"] = await asyncio.wait_for(
            big_bodies(client, url, tally, args.max_body_bytes), timeout=600
        )
    out["stalled"] = await asyncio.to_thread(stalled_clients, url, args.client_timeout)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--client-timeout", type=float, default=5.0)
    ap.add_argument("--max-body-bytes", type=int, default=32 << 20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    proc, url, log = harness.start_serve(
        args.model,
        [
            "--threads", str(args.threads), "--client-timeout", str(args.client_timeout),
            "--max-body-bytes", str(args.max_body_bytes),
        ],
        timeout=300,
    )  # fmt: skip
    tally = Tally()
    rounds = []
    ok = True
    try:
        httpx.post(
            url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 2}, timeout=300
        )
        before = proc_stats(proc.pid)
        for i in range(args.rounds):
            result = asyncio.run(round_(url, args, tally))
            time.sleep(1)  # let closed connections leave the server's table
            result["idle"] = idle(url)
            result["after"] = proc_stats(proc.pid)
            rounds.append(result)
            print(json.dumps({"round": i + 1, **result}), flush=True)
            if any(v != 0 for v in result["idle"].values()):
                ok = False
        fds_back = rounds[-1]["after"]["fds"] <= before["fds"] + 2
        ok = ok and fds_back and not tally.server_errors and not tally.hangs
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    summary = {
        "model": args.model,
        "before": before,
        "rounds": rounds,
        "statuses": tally.statuses,
        "server_errors": tally.server_errors,
        "exit_code": code,
        "tracebacks_in_log": sum("Traceback" in ln for ln in log),
        "ok": ok and code == 0,
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        harness.write_json(args.json, summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
