"""Every flag of every command is documented, defaults come from the parser, output fits."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from prefixflight.cli import main
from prefixflight.cli._main import build_parser


def parsers(
    parser: argparse.ArgumentParser,
) -> Iterator[tuple[argparse.ArgumentParser, list[argparse.Action]]]:
    actions = list(parser._actions)
    yield parser, actions
    for action in actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from parsers(child)


def test_every_flag_of_every_command_has_a_help_text() -> None:
    seen = 0
    for parser, actions in parsers(build_parser()):
        for action in actions:
            if action.option_strings or action.dest not in ("command", "simulation", "bench"):
                assert action.help and action.help.strip(), (parser.prog, action.dest)
                seen += 1
    assert seen > 80  # every command was walked


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["replay"],
        ["sweep"],
        ["simulate", "flight"],
        ["simulate", "router"],
        ["bench", "ttft"],
        ["bench", "calibrate"],
        ["demo"],
        ["serve"],
    ],
)
def test_help_shows_defaults_once_and_names_no_internal_references(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for entry in re.split(r"\s(?=--?[a-z])", text):  # one option's help at a time
        assert entry.count("(default") <= 1, entry
        # a help that names its default in words gets no second "(default: ...)"
        before, shown, _ = entry.partition("(default:")
        assert not (shown and re.search(r"\bdefault\b", before, re.IGNORECASE)), entry
    assert "default: None" not in text and "default: False" not in text
    for internal in ("seed 0", "DESIGN.md", "MODEL.md", "PEERS.md"):
        assert internal not in text


def test_help_defaults_are_the_parser_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "router", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-batch-size N burst: the most requests" in text
    assert "(default: 1000)" in text and "(default: requests)" in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert re.fullmatch(r"prefixflight \S+\n", capsys.readouterr().out)


def test_simulate_flight_fits_120_columns(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "flight", "--output-tokens", "8", "--late-after-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 120
    assert "- fixed share 0.00:" in out  # the long findings are a list


def test_a_command_imports_only_its_own_module() -> None:
    # what start-up pays for: `prefixflight replay` registers the replay command alone and
    # loads the cache's replay modules, not the curves, the hashers or the other commands
    code = (
        "import json, sys; from prefixflight.cli._main import main; "
        "main(['replay', 'bundled:conversation', '--capacity-blocks', '64', '-q', "
        "'-o', sys.argv[1]]); print(json.dumps([m for m in sys.modules if m.startswith('prefix')]))"
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [sys.executable, "-c", code, f"{tmp}/r.json"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    loaded = set(json.loads(out.stdout))
    assert "prefixflight.cli._replay_cmd" in loaded
    assert "prefixflight.core.cache._replay" in loaded
    for absent in ("_sweep_cmd", "_serve_cmd", "_simulate_cmd", "_bench_cmd", "_curves",
                   "_hashing", "flight", "routing"):  # fmt: skip
        assert not [m for m in loaded if m.rsplit(".", 1)[-1] == absent], absent


def test_the_top_level_help_still_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    from prefixflight.cli._main import COMMANDS

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_every_torch_command_describes_the_dtype_default_the_backend_picks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # resolve_dtype(None, device): bf16 on CUDA and on CPUs with native bf16, else fp32
    for argv in (["demo"], ["bench", "ttft"], ["bench", "calibrate"], ["serve"]):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert (
            "--dtype DTYPE bfloat16, float32 or float16 (default: bfloat16 on CUDA and on CPUs "
            "with native bf16, AVX512-BF16 or AMX; float32 on other CPUs)" in text
        ), argv


def test_an_option_table_row_is_one_flag() -> None:
    from prefixflight.cli._args import Parser, add_options, at_least

    p = Parser(prog="t")
    add_options(p, [("--n", at_least(1), 3, "N", "a count"), ("--name", None, None, None, "a")])
    assert vars(p.parse_args([])) == {"n": 3, "name": None}
    assert vars(p.parse_args(["--n", "5", "--name", "x"])) == {"n": 5, "name": "x"}
    with pytest.raises(SystemExit):
        p.parse_args(["--n", "0"])
    assert "--n N" in p.format_help() and "(default: 3)" in p.format_help()
