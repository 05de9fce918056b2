"""The user's documents: every ```python block in README.md and docs/*.md runs as
written, the README stays a short user's page that names no commit, its links
lead somewhere, and the generated performance pages are what the results give."""
import importlib.util
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").glob("*.md"))
# blocks that need more than one process: run by their own tests (tests/integrations/test_distributed.py)
ELSEWHERE = ("torchrun --nproc-per-node",)


def _blocks(page):
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


BLOCKS = [(page, i, b) for page in PAGES for i, b in enumerate(_blocks(page))
          if not any(s in b for s in ELSEWHERE)]


def test_readme_has_examples():
    assert len(_blocks(README)) >= 2


@pytest.mark.parametrize("page,i,block", BLOCKS, ids=[f"{p.relative_to(ROOT)}-{i}" for p, i, _ in BLOCKS])
def test_block_runs(page, i, block, capsys):
    if "transformers" in block and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers (pip install '.[transformers]')")
    exec(compile(block, f"{page.relative_to(ROOT)} block {i}", "exec"), {"__name__": "__docs__"})
    lines = capsys.readouterr().out.splitlines()
    # a block shows its reader something, and what the page says prints True does
    assert lines, "the block printed nothing"
    promised = [m.strip() for m in re.findall(r"print\(.*\)\s*#\s*((?:True\s*)+)$", block, flags=re.M)]
    for want in set(promised):
        assert lines.count(want) >= promised.count(want), (want, lines)
    assert not any("False" in line.split() for line in lines), lines


def test_readme_is_a_users_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 350
    for needed in ("pip install", "make test", "make demo", "swap_attention", "docs/contract.md",
                   "benchmarks/results/cpus.png"):
        assert needed in text, needed


def _commits():
    out = subprocess.run(["git", "rev-list", "--all", "--abbrev-commit", "--abbrev=7"], cwd=ROOT,
                         capture_output=True, text=True)
    return set(out.stdout.split()) if out.returncode == 0 else set()


def test_readme_names_no_commit():
    commits = _commits()
    if not commits:
        pytest.skip("needs the git history")
    words = set(re.findall(r"\b[0-9a-f]{7,40}\b", README.read_text()))
    named = {w for w in words if any(c.startswith(w[:7]) for c in commits)}
    assert not named, named


def test_links_lead_somewhere():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)}: {target}"


def test_performance_pages_are_generated_from_the_results():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "benchmarks" / "readme_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--check"]) == 0, "run python benchmarks/readme_tables.py"
    assert (ROOT / "benchmarks" / "results" / "cpus.png").is_file()
