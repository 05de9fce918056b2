"""examples/quickstart.ipynb runs top to bottom (so it cannot rot)."""
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples", "quickstart.ipynb")


def test_quickstart_notebook_executes():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # run from examples/, as a user of a clone does: the notebook finds research/ beside it
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
    client.execute()  # raises CellExecutionError on any failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    figures = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(figures) >= 3, f"expected the level-weight, score-map and split figures, got {len(figures)}"
    # the swap keeps the function; the split's energies add up; the cost is 1.3125x at L = 3
    change = float(text.split("max |logit change| from the swap:")[1].split()[0])
    assert change < 1e-4
    assert text.count("sum 1.000") == 3
    assert "L=3: score cost 1.3125x standard attention (the CPU kernel at T=S=4096: 1.3125x)" in text
