"""benchmarks/bench_byzfl.py: ByzFL's cell figure from the runs' curves, and the sweeps run N at a
time within a budget."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench_byzfl(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_byzfl

    return bench_byzfl


def test_a_cell_is_the_worst_attacks_best_of_the_seeds_mean_curve(bench_byzfl):
    curves = {
        ("trimmed_mean", 0.33, 4, "sign_flip"): [[0.2, 0.8, 0.6], [0.4, 0.6, 0.9]],  # mean .3 .7 .75: best .75
        ("trimmed_mean", 0.33, 4, "optimal_ipm"): [[0.5, 0.9, 0.7], [0.5, 0.5, 0.8]],  # mean .5 .7 .75: best .75
        ("trimmed_mean", 0.33, 4, "optimal_alie"): [[0.1, 0.7]],  # one seed only: best .7
        ("trimmed_mean", 0.0, 1, "sign_flip"): [[0.3, 0.2]],
    }
    cells = {(c["gamma"], c["f"]): c for c in bench_byzfl.heatmap(curves)}
    hard = cells[(0.33, 4)]
    assert hard["accuracy"] == pytest.approx(0.7) and hard["worst_attack"] == "optimal_alie"
    assert (hard["attacks"], hard["seeds"]) == (3, 1)  # the cell lacks seeds: it says so
    assert (cells[(0.0, 1)]["accuracy"], cells[(0.0, 1)]["attacks"]) == (0.3, 1)
    assert list(cells) == [(0.33, 4), (0.0, 1)]  # gamma down, as ByzFL's heatmaps
    assert hard["by_attack"] == pytest.approx({"sign_flip": 0.75, "optimal_ipm": 0.75, "optimal_alie": 0.7})
    table = bench_byzfl.attack_table(list(cells.values())).splitlines()
    assert table[0].split() == ["rule", "gamma", "f", "sign_flip", "optimal_ipm", "optimal_alie"]  # ByzFL's order
    assert table[2].split() == ["trimmed_mean", "0.33", "4", "0.7500", "0.7500", "0.7000"]


def test_a_heatmap_leaves_cells_not_run_in_full_blank_and_shows_the_whole_grid(bench_byzfl, tmp_path):
    def cell(gamma, f, accuracy, attacks=3, seeds=3):
        return {
            "rule": "trimmed_mean",
            "gamma": gamma,
            "f": f,
            "accuracy": accuracy,
            "attacks": attacks,
            "seeds": seeds,
        }

    cells = [cell(0.33, 1, 0.97), cell(0.33, 2, 0.5, seeds=2), cell(0.0, 1, 0.8, attacks=1)]
    full = bench_byzfl.fullest(cells)
    assert full == (3, 3)
    down, across, rows = bench_byzfl.heatmap_rows(cells, full, gammas=(1.0, 0.33), fs=(1, 2, 3))
    assert (down, across) == ([1.0, 0.33, 0.0], [1, 2, 3])  # gamma down, as ByzFL's heatmaps
    # a cell short of seeds or attacks is not ByzFL's figure (the worst attack over all seeds): blank
    assert rows == [[None, None, None], [0.97, None, None], [None, None, None]]
    (path,) = bench_byzfl.write_heatmaps({"fedsim": {"cells": cells}}, tmp_path, (1.0, 0.33), (1, 2, 3))
    assert path == tmp_path / "fedsim_trimmed_mean_heatmap.png" and path.stat().st_size > 0


def test_commands_run_n_at_a_time_and_stop_at_the_budget(bench_byzfl, tmp_path):
    """Two sleepers run at once (each leaves its mark), the budget stops both, the third never starts."""
    marks = [tmp_path / f"ran{i}" for i in range(3)]
    sleepers = [[sys.executable, "-c", f"import time; open({str(m)!r}, 'w'); time.sleep(60)"] for m in marks]
    started = time.perf_counter()
    bench_byzfl.timed(sleepers, tmp_path, {}, parallel=2, budget_s=1.5)
    assert time.perf_counter() - started < 30  # stopped, not waited for
    assert [m.exists() for m in marks] == [True, True, False]


def test_a_failing_command_names_itself(bench_byzfl, tmp_path):
    with pytest.raises(RuntimeError, match="(?i)no such file"):
        bench_byzfl.timed([[sys.executable, "-c", "open('/no/such/file')"]], tmp_path, {})


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_commands_at_once_are_bound_to_cores_of_their_own(bench_byzfl, tmp_path):
    import os

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: nothing to share out")
    marks = [tmp_path / f"cores{i}" for i in range(2)]
    code = "import os, time; open({!r}, 'w').write(' '.join(map(str, sorted(os.sched_getaffinity(0))))); time.sleep(1)"
    commands = [[sys.executable, "-c", code.format(str(m))] for m in marks]
    bench_byzfl.timed(commands, tmp_path, {}, parallel=2, share_cores=True)
    bound = [set(map(int, m.read_text().split())) for m in marks]
    share = len(cores) // 2
    assert all(len(b) == share and b <= set(cores) for b in bound) and not bound[0] & bound[1]


@pytest.mark.slow
def test_the_table_of_sweeps_already_run_names_the_machine_they_ran_on(bench_byzfl, tmp_path, capsys):
    """--from-sweep: the cells, the rules x attacks table and the JSON of a sweep of the experiment
    file (two rounds on generated data here), with the machine the runs recorded, not this one."""
    import json

    import fedsim

    experiment = REPO / "experiments" / "robustness" / "byzfl.yaml"
    overrides = ["rounds=2", "eval_every=1", "data.dataset=synthetic", "workers=0", "checkpoint_every=0"]
    grid = ["rule=trimmed_mean", "attack.count=1", "data.gamma=0.33", "attack.type=sign_flip,optimal_ipm"]
    fedsim.sweep(str(experiment), grid, overrides, out=tmp_path / "sweep", quiet=True, seeds=[0])
    output = tmp_path / "table.json"
    assert bench_byzfl.main(["--from-sweep", str(tmp_path / "sweep"), "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    (cell,) = json.loads(output.read_text())["sides"]["fedsim"]["cells"]
    assert (cell["rule"], cell["gamma"], cell["f"], cell["attacks"], cell["seeds"]) == ("trimmed_mean", 0.33, 1, 2, 1)
    assert cell["accuracy"] == min(cell["by_attack"].values())
    (machine,) = json.loads(output.read_text())["sides"]["fedsim"]["ran_on"]
    summary = json.loads(next((tmp_path / "sweep").glob("*/summary.json")).read_text())
    assert machine["runs"] == 2 and machine["device_name"] == summary["device_name"]
    assert machine["torch"] == summary["torch"] and machine["cpus"] == summary["cpus"]
    assert f"2 runs ran on {summary['device_name']}" in printed
    assert "sign_flip" in printed and "optimal_ipm" in printed
