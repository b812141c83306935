"""How the CLI fails: one line on stderr and the right exit status for bad input, bad flags
and outputs that cannot be written, never a traceback or a partial file (cases found by
outside probing). Where the case is about the process (exit status, one line on stderr, no
traceback, /dev/full, a closed stdin), the CLI runs as a real subprocess."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prefixflight.cli import main
from prefixflight.cli._io import write_atomic

GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}
GOOD_LINES = b"".join(
    json.dumps({**GOOD, "timestamp": i, "hash_ids": [1, i + 2]}).encode() + b"\n"
    for i in range(200)
)
TIMEOUT = 60


def cli(
    *args: str,
    stdin: bytes | None = None,
    shell_redirect: str = "",
    **kwargs: object,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``python -m prefixflight.cli ARGS`` as a process (through ``sh`` when a redirection
    such as ``<&-`` is needed)."""
    argv = [sys.executable, "-m", "prefixflight.cli", *args]
    if shell_redirect:
        argv = ["sh", "-c", f'exec "$@" {shell_redirect}', "sh", *argv]
    kwargs.setdefault("stdout", subprocess.PIPE)
    proc: subprocess.CompletedProcess[bytes] = subprocess.run(
        argv,
        input=stdin,
        stderr=subprocess.PIPE,
        timeout=TIMEOUT,
        **kwargs,  # type: ignore[call-overload]
    )
    return proc


def one_line_error(proc: subprocess.CompletedProcess[bytes], status: int, *fragments: str) -> str:
    """The error line; a usage error (status 2) is followed by one line pointing to --help."""
    err = proc.stderr.decode()
    assert proc.returncode == status, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    if status == 2:
        assert len(lines) == 2 and re.fullmatch(r"Try '.+ --help' for the usage\.", lines[1]), err
    else:
        assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, err)
    return lines[0]


# -- one line, no traceback------------------------------------------------------------------


def test_a_truncated_gz_is_a_one_line_error(tmp_path: Path) -> None:
    data = gzip.compress(GOOD_LINES)
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(data[: len(data) // 2])
    corrupt = tmp_path / "bad.jsonl.gz"
    corrupt.write_bytes(data[:20] + bytes(b ^ 0x5A for b in data[20:60]) + data[60:])
    for path in (truncated, corrupt):
        for extra in ([], ["--skip-invalid"]):  # not line-local: never skipped
            proc = cli("replay", str(path), "--capacity-blocks", "8", *extra)
            one_line_error(proc, 1, str(path), "corrupt or truncated gzip data")


def test_a_deeply_nested_line_is_a_line_error_and_skippable(tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    path.write_bytes(GOOD_LINES + b"[" * 100_000 + b"\n" + GOOD_LINES)
    proc = cli("replay", str(path), "--capacity-blocks", "8")
    one_line_error(proc, 1, f"{path}:201:", "nested too deeply")
    proc = cli("replay", str(path), "--capacity-blocks", "8", "--skip-invalid")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["skipped_lines"], report["total_requests"]) == (1, 400)


def test_a_deeply_nested_config_is_a_one_line_error(tmp_path: Path) -> None:
    config = tmp_path / "deep.json"
    config.write_bytes(b"[" * 100_000)
    proc = cli("replay", "bundled:synthetic", "--capacity-blocks", "8", "--config", str(config))
    one_line_error(proc, 1, str(config), "nested too deeply")


def test_a_config_that_is_not_utf8_is_a_one_line_error(tmp_path: Path) -> None:
    config = tmp_path / "latin1.json"
    config.write_bytes(b'{\n  "policy": "lru",\n  "note\xe9": 1\n}\n')
    proc = cli("replay", "bundled:synthetic", "--config", str(config))
    one_line_error(proc, 1, str(config), "not valid UTF-8", "line 3", "0xe9")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_stdout_on_a_full_device_is_a_one_line_error(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(GOOD_LINES)
    with open("/dev/full", "wb") as full:
        proc = cli("replay", str(trace), "--capacity-blocks", "8", stdout=full)
    one_line_error(proc, 1, "cannot write to stdout", "No space left on device")


def test_a_closed_stdin_is_a_one_line_error() -> None:
    proc = cli("replay", "-", "--capacity-blocks", "8", shell_redirect="<&-")
    one_line_error(proc, 1, "stdin", "closed")


@pytest.mark.parametrize("via_stdin", [False, True])
def test_bad_utf8_in_a_trace_is_a_line_error_with_its_number(
    tmp_path: Path, via_stdin: bool
) -> None:
    bad = b'{"input_length": 5, "hash_ids": [1], "note": "caf\xe9"}\n'
    data = GOOD_LINES + bad + GOOD_LINES
    path = tmp_path / "bad.jsonl"
    path.write_bytes(data)
    spec, name, stdin = ("-", "<stdin>", data) if via_stdin else (str(path), str(path), None)
    proc = cli("replay", spec, "--capacity-blocks", "8", stdin=stdin)
    one_line_error(proc, 1, f"{name}:201: not valid UTF-8 (byte 0xe9 at column 50)")
    proc = cli("replay", spec, "--capacity-blocks", "8", "--skip-invalid", stdin=stdin)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["skipped_lines"], report["total_requests"]) == (1, 400)


def test_gzip_on_stdin_is_detected(tmp_path: Path) -> None:
    plain = cli("replay", "-", "--capacity-blocks", "8", stdin=GOOD_LINES)
    zipped = cli("replay", "-", "--capacity-blocks", "8", stdin=gzip.compress(GOOD_LINES))
    assert plain.returncode == zipped.returncode == 0, zipped.stderr
    assert json.loads(zipped.stdout) == json.loads(plain.stdout)
    assert json.loads(plain.stdout)["total_requests"] == 200


# -- output files -------------------------------------------------------------------------


def _limit_file_size() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))


@pytest.mark.parametrize("command", ["replay", "sweep", "simulate router", "simulate flight"])
def test_a_failed_write_keeps_the_old_file_and_leaves_no_partial(
    tmp_path: Path, command: str
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(GOOD_LINES)
    out = tmp_path / "out" / "result.json"
    out.parent.mkdir()
    old = json.dumps({"previous": "result", "padding": "x" * 200}) + "\n"
    out.write_text(old)
    args = {
        "replay": ["replay", str(trace), "--capacity-blocks", "8", "-o", str(out)],
        "sweep": ["sweep", str(trace), "--capacities", "2,8", "-j", "1", "--json", str(out)],
        "simulate router": [
            "simulate",
            "router",
            "--steps",
            "2",
            "--prompts",
            "2",
            "--json",
            str(out),
        ],
        "simulate flight": [
            "simulate",
            "flight",
            "--output-tokens",
            "8",
            "--late-after-tokens",
            "2",
            "--json",
            str(out),
        ],
    }[command]
    proc = cli(*args, preexec_fn=_limit_file_size)
    one_line_error(proc, 1, "cannot write", str(out))
    assert out.read_text() == old
    assert sorted(p.name for p in out.parent.iterdir()) == ["result.json"]


def test_write_atomic_replaces_whole_files_only(tmp_path: Path) -> None:
    target = tmp_path / "r.json"
    target.write_text("old\n")
    os.chmod(target, 0o640)
    write_atomic(target, "new\n")
    assert target.read_text() == "new\n"
    assert target.stat().st_mode & 0o777 == 0o640  # the mode of the file it replaces
    with pytest.raises(Exception, match="cannot write"):
        write_atomic(tmp_path / "no-such-dir" / "r.json", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


# -- usage errors exit 2, bad input data exits 1 -----------------------------------------


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["replay", "bundled:synthetic", "--capacity-blocks", "-1"], "--capacity-blocks"),
        (
            ["replay", "bundled:synthetic", "--capacity-blocks", "8", "--small-ratio", "1.5"],
            "--small-ratio",
        ),
        (
            ["replay", "bundled:synthetic", "--capacity-blocks", "8", "--block-size", "0"],
            "--block-size",
        ),
        (
            [
                "replay",
                "bundled:synthetic",
                "--capacity-blocks",
                "8",
                "--max-freq",
                "2",
                "--ghost-admit-freq",
                "3",
            ],
            "ghost_admit_freq",
        ),
        (
            ["sweep", "bundled:synthetic", "--capacities", "8", "--small-ratio", "nan"],
            "--small-ratio",
        ),
        (["simulate", "router", "--replicas", "0"], "--replicas"),
        (["simulate", "router", "--window-ms", "20000"], "window_ms"),
        (
            ["simulate", "flight", "--output-tokens", "8", "--late-after-tokens", "9"],
            "--late-after-tokens",
        ),
        (["bench", "ttft", "--threads", "0"], "--threads"),
    ],
)
def test_invalid_flag_values_exit_2(args: list[str], fragment: str) -> None:
    proc = cli(*args)
    line = one_line_error(proc, 2, fragment)
    assert line.startswith("prefixflight ")


def test_bad_input_data_exits_1(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"input_length": -5, "hash_ids": []}\n')
    one_line_error(cli("replay", str(trace), "--capacity-blocks", "8"), 1, f"{trace}:1:")
    config = tmp_path / "c.json"
    config.write_text('{"cache_capacity_blocks": -1}')
    proc = cli("replay", str(trace), "--config", str(config))
    one_line_error(proc, 1, str(config), "cache_capacity_blocks")


# -- NaN timestamps, -o '', byte order marks -----------------------------------------------


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_timestamps_are_rejected_naming_the_field(
    tmp_path: Path, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(f'{{"timestamp": {value}, "input_length": 5, "hash_ids": [1]}}\n')
    assert main(["replay", str(trace), "--capacity-blocks", "8"]) == 1
    assert f"{trace}:1: field 'timestamp': must be finite" in capsys.readouterr().err


def test_a_usage_error_is_the_error_and_a_pointer_to_help_not_the_usage() -> None:
    proc = cli("serve", "--port", "70000")
    assert proc.stderr.decode().splitlines() == [
        "prefixflight serve: error: argument --port: a port is at most 65535, got '70000'",
        "Try 'prefixflight serve --help' for the usage.",
    ]
    proc = cli("bench")  # a command with sub-commands points to its own --help
    one_line_error(proc, 2, "prefixflight bench: error: the following arguments are required")
    assert "Try 'prefixflight bench --help'" in proc.stderr.decode()


def test_an_empty_output_path_is_a_usage_error() -> None:
    proc = cli("replay", "bundled:synthetic", "--capacity-blocks", "8", "-o", "")
    one_line_error(proc, 2, "-o/--output", "expected a file name")


def test_a_byte_order_mark_is_accepted_in_trace_and_config(tmp_path: Path) -> None:
    trace = tmp_path / "bom.jsonl"
    trace.write_bytes(b"\xef\xbb\xbf" + GOOD_LINES)
    config = tmp_path / "bom.json"
    config.write_bytes(b"\xef\xbb\xbf" + b'{"cache_capacity_blocks": 8}')
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(GOOD_LINES)
    reports = [
        cli("replay", str(trace), "--config", str(config)),
        cli("replay", "-", "--capacity-blocks", "8", stdin=b"\xef\xbb\xbf" + GOOD_LINES),
        cli("replay", str(plain), "--capacity-blocks", "8"),
    ]
    assert [p.returncode for p in reports] == [0, 0, 0], [p.stderr for p in reports]
    first, *rest = (json.loads(p.stdout) for p in reports)
    assert all(r == first for r in rest) and first["total_requests"] == 200
