"""Every notebook runs top to bottom, tiny and on CPU.

Parameters are injected the way papermill does it: a cell of assignments is inserted right
after the cell tagged ``parameters``, so the notebook's own set-up still runs after it. The
data root given is empty, so every notebook takes its fallback to the generated dataset (quick,
and the same with or without ``FEDSIM_DATA``); runs go to a temporary folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
SMALL = {
    "ROUNDS": 2,
    "SEEDS": [0, 1],
    "DATA_LIMIT": 800,
    "NUM_CLIENTS": 8,
    "CLIENTS_PER_ROUND": 4,
    "LOCAL_EPOCHS": 1,
    "DEVICE": "cpu",
    "WORKERS": 0,
}


def with_parameters(nb, values: dict):
    tagged = [i for i, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, "a notebook needs exactly one cell tagged 'parameters'"
    injected = nbformat.v4.new_code_cell("\n".join(f"{name} = {value!r}" for name, value in values.items()))
    injected.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(tagged[0] + 1, injected)
    return nb


def files_under(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if ".ipynb_checkpoints" not in p.parts}


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS.glob("*.ipynb")} >= {
        "compare_aggregators.ipynb",
        "partitions.ipynb",
        "quickstart.ipynb",
    }


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path):
    before = files_under(NOTEBOOKS)
    small = {**SMALL, "DATA_ROOT": str(tmp_path / "no-data"), "RUNS": str(tmp_path / "runs")}
    nb = with_parameters(nbformat.read(path, as_version=4), small)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, on the first error

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure was shown"
    assert files_under(NOTEBOOKS) == before, "the notebook left files in notebooks/"
    assert any((tmp_path / "runs").rglob("metrics.csv"))
