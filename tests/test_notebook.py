"""The Colab quickstart executes end to end (tiny config, no install) and shows its numbers."""

import nbformat
import pytest
from nbclient import NotebookClient

from tests.helpers import ROOT

NOTEBOOK = ROOT / "experiments" / "colab" / "quickstart.ipynb"

pytestmark = pytest.mark.multiprocess  # a kernel process, a gRPC syncer and two learners


def _text(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", ""))
        parts.append(output.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("DD_NOTEBOOK_TEST", "1")  # the parameters cell: no pip install, tiny run
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    parameters = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(parameters) == 1 and "DD_NOTEBOOK_TEST" in parameters[0].source
    client = NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    text = "\n".join(_text(c) for c in notebook.cells if c.cell_type == "code")
    assert "trained 16 steps on each of 2 learners" in text
    assert "global model: eval loss" in text
    eval_loss = float(text.split("global model: eval loss ")[1].split()[0])
    assert eval_loss < 5.3  # well below the untrained ln(256) = 5.55
    assert "goodput" in text and "data-parallel equivalent" in text
    accuracy = float(text.split("your model: accuracy ")[1].split("%")[0])
    assert accuracy > 50 and "images" in text  # the user's MLP learned the digits
    images = [
        o for c in notebook.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})
    ]
    assert len(images) >= 2  # the loss plot and the timeline
