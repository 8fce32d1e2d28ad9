"""Every notebook runs top to bottom, tiny and on CPU, headless: papermill sets its ``SMALL``
parameter (and ``RUNS``, a temporary folder), as the command of docs/results.md does. ``SMALL``
takes every notebook to the generated dataset (quick, and the same with or without
``FEDSIM_DATA``)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
papermill = pytest.importorskip("papermill")

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"


def files_under(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if ".ipynb_checkpoints" not in p.parts}


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS.glob("*.ipynb")} >= {
        "compare_aggregators.ipynb",
        "partitions.ipynb",
        "quickstart.ipynb",
    }


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_a_notebook_is_parametrised_and_has_a_small_size(path):
    nb = nbformat.read(path, as_version=4)
    tagged = [i for i, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, "a notebook needs exactly one cell tagged 'parameters'"
    assert "SMALL = False" in nb.cells[tagged[0]].source
    assert nb.cells[tagged[0] + 1].source.startswith("if SMALL:")  # after papermill's cell, before the set-up


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path):
    before = files_under(NOTEBOOKS)
    out = tmp_path / path.name
    papermill.execute_notebook(
        str(path),
        str(out),
        parameters={"SMALL": True, "RUNS": str(tmp_path / "runs")},
        cwd=str(NOTEBOOKS),
        kernel_name="python3",
        progress_bar=False,
        execution_timeout=300,
    )  # raises PapermillExecutionError, naming the cell, on the first error

    nb = nbformat.read(out, as_version=4)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure was shown"
    assert files_under(NOTEBOOKS) == before, "the notebook left files in notebooks/"
    assert any((tmp_path / "runs" / "small").rglob("metrics.csv"))


@pytest.mark.slow
def test_the_notebook_command_of_the_docs_runs(tmp_path):
    page = (REPO / "docs" / "results.md").read_text()
    section = page[page.index("## Notebooks") :]
    (block,) = re.findall(r"^```bash\n(.*?)^```", section[: section.index("\n## ")], re.M | re.S)
    (words,) = [w for line in block.splitlines() if (w := shlex.split(line, comments=True))[:1] == ["papermill"]]
    out = tmp_path / "out.ipynb"
    words[2] = str(out)  # the executed copy, and the runs, go to the temporary folder
    done = subprocess.run(
        [sys.executable, "-m", *words, "-p", "RUNS", str(tmp_path / "runs")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert any((tmp_path / "runs" / "small").rglob("metrics.csv")) and out.is_file()
