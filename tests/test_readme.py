"""Every ```python block in README.md runs as written."""
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_block_runs(i, capsys):
    exec(compile(BLOCKS[i], f"README.md block {i}", "exec"), {"__name__": "__readme__"})
    lines = capsys.readouterr().out.splitlines()
    # a block shows its reader something, and what the README says prints True does
    assert lines, "the block printed nothing"
    promised = [m.strip() for m in re.findall(r"print\(.*\)\s*#\s*((?:True\s*)+)$", BLOCKS[i], flags=re.M)]
    for want in set(promised):
        assert lines.count(want) >= promised.count(want), (want, lines)
    assert not any("False" in line.split() for line in lines), lines
