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
    out = capsys.readouterr().out
    assert "False" not in out.split("\n")[0]  # the swap example prints True first
