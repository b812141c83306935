"""A missing optional dependency is a one-line error naming the extra and a command that
installs it: prefixflight is not on the package index, so the command installs from the clone
(``pip install -e '.[EXTRA]'``), never ``pip install 'prefixflight[EXTRA]'``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from prefixflight.cli import main
from prefixflight.core._extras import install_command

from ..conftest import source_roots

ROOT = Path(__file__).resolve().parents[2]


def test_an_extra_installs_from_the_clone_and_torch_brings_its_cpu_wheel_first() -> None:
    assert install_command("serve") == "pip install -e '.[serve]'"
    assert install_command("torch") == "pip install torch==2.13.0 && pip install -e '.[torch]'"


def forget(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    """Unload ``module`` and its submodules, so the next import runs it again."""
    for name in list(sys.modules):
        if name == module or name.startswith(module + "."):
            monkeypatch.delitem(sys.modules, name)
    parent, _, child = module.rpartition(".")
    if parent and parent in sys.modules:  # ``from parent import child`` reads the attribute
        monkeypatch.delattr(sys.modules[parent], child, raising=False)


def block(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    """Make importing ``module`` fail as if it were not installed."""
    forget(monkeypatch, module)
    monkeypatch.setitem(sys.modules, module, None)


@pytest.mark.parametrize(
    ("blocked", "argv", "status", "extra"),
    [
        ("matplotlib", ["sweep", "bundled:synthetic", "--capacities", "8", "--plot", "x.png",
                        "-q"], 1, "plot"),
        ("prefixflight.serve.http", ["serve", "--port", "0"], 1, "serve"),
        ("prefixflight.serve.route", ["route", "--backend", "http://127.0.0.1:1"], 1, "serve"),
        ("torch", ["demo", "-q"], 1, "torch"),
        ("prefixflight.specs._conform", ["conform", "vllm"], 2, "specs"),
    ],
)  # fmt: skip
def test_a_missing_extra_names_the_command_that_installs_it_from_the_clone(
    blocked: str,
    argv: list[str],
    status: int,
    extra: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the torch commands set it if unset
    forget(monkeypatch, "prefixflight.backends.torch")  # imported again, it imports torch
    block(monkeypatch, blocked)
    if status == 2:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    else:
        assert main(argv) == status
    err = capsys.readouterr().err
    assert f"needs the {extra} extra" in err and f"`{install_command(extra)}`" in err, err
    assert "Traceback" not in err and "prefixflight[" not in err


def test_the_ray_flags_name_the_ray_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the torch commands set it if unset
    block(monkeypatch, "ray")
    assert main(["serve", "--replicas", "1", "--model", "tiny"]) == 1
    err = capsys.readouterr().err
    assert "--replicas needs the ray extra" in err and install_command("ray") in err, err


def test_the_conformance_kit_names_the_command_that_installs_the_extras() -> None:
    pytest.importorskip("hypothesis")
    from prefixflight.specs._conform import _not_installed

    message = _not_installed("prefixflight", ImportError("No module named 'fastapi'"))
    assert f"`{install_command('all')}`" in message, message


def test_no_source_spells_an_install_from_the_package_index() -> None:
    """Every hint comes from `install_command`: no module writes its own."""
    for root in source_roots():
        for path in root.rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            assert "'prefixflight[" not in text and '"prefixflight[' not in text, path
