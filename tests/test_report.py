import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from matplotlib.figure import Figure

from fedsim.cli import main
from fedsim.data import load_dataset, options_for, partition
from fedsim.data.report import partition_figure, partition_stats, summary_text, write_report
from fedsim.experiment.federation import load_federation
from fedsim.experiment.validation import load_config

REPO = Path(__file__).resolve().parents[1]


def test_partition_stats_counts_samples_per_client_and_class():
    labels = np.array([0, 1, 1, 2, 2, 2, 0])
    stats = partition_stats([np.array([0, 1, 2]), np.array([3, 4, 5, 6]), np.array([], dtype=int)], labels, 4)
    assert stats["samples"] == [3, 4, 0]
    assert stats["class_counts"] == [[1, 2, 0, 0], [1, 0, 3, 0], [0, 0, 0, 0]]
    assert stats["num_clients"] == 3 and stats["num_classes"] == 4


def test_summary_is_one_paragraph_of_sizes_and_classes():
    stats = {
        "num_clients": 5,
        "num_classes": 3,
        "class_counts": [[5, 0, 0], [2, 2, 0], [1, 1, 1], [0, 0, 0], [0, 0, 3]],
        "samples": [5, 4, 3, 0, 3],
    }
    text = summary_text(stats)
    assert "\n" not in text
    assert "5 clients hold 15 samples of 3 classes" in text
    assert "min 0, median 3, max 5" in text
    assert "1.40 classes on average (min 0, max 3)" in text
    assert "1 client gets no samples" in text


@pytest.mark.parametrize("num_clients", [6, 120])
def test_partition_figure_draws_a_labelled_heat_map(num_clients):
    labels = np.random.default_rng(0).integers(0, 10, 3000)
    parts = partition(labels, "dirichlet", num_clients, seed=0, alpha=0.3, min_samples=0)
    fig = partition_figure(partition_stats(parts, labels, 10), "a title")
    assert isinstance(fig, Figure)
    bar_ax, heat_ax = fig.axes[:2]
    assert heat_ax.get_xlabel() == "client" and heat_ax.get_ylabel() == "class"
    assert bar_ax.get_title() == "a title" and bar_ax.get_ylabel() == "samples"
    assert heat_ax.images[0].get_array().shape == (10, num_clients)
    assert "samples" in fig.axes[-1].get_ylabel()  # the colour bar
    assert len(heat_ax.get_xticks()) <= 27  # thinned ticks for many clients
    fig.savefig(io.BytesIO(), format="png")


@pytest.mark.slow
def test_write_report_splits_the_data_as_a_run_does(tmp_path, small_config):
    cfg = load_config(small_config, {"data.partition": "dirichlet", "data.alpha": 0.2, "data.test_partition": True})
    report = write_report(cfg, load_federation(cfg), tmp_path / "out")
    data = load_dataset(cfg.data.dataset, cfg.data.root, cfg.data.limit)
    parts = partition(data.train_y, "dirichlet", cfg.data.num_clients, cfg.seed, **options_for("dirichlet", cfg.data))
    assert report["samples"] == [len(p) for p in parts]
    written = json.loads((tmp_path / "out" / "partition.json").read_text())
    assert written["class_counts"] == report["class_counts"] and written["options"] == {
        "alpha": 0.2,
        "min_samples": 1,
        "balanced": False,
    }
    assert sum(written["test_samples"]) == len(data.test_y)
    assert (tmp_path / "out" / "partition.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_fedsim_partition_command_writes_json_and_png(tmp_path, small_config):
    config = {**small_config, "data": {**small_config["data"], "partition": "shards", "shards_per_client": 2}}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "fedsim", "partition", str(path), "--set", "name=shardy"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = tmp_path / "runs" / "shardy-partition"
    assert (
        f"{config['data']['num_clients']} clients hold" in done.stdout
        and str(Path("runs") / "shardy-partition") in done.stdout
    )
    report = json.loads((out / "partition.json").read_text())
    total = config["data"].get("limit") or 6000
    assert report["num_clients"] == 8 and report["num_classes"] == 10 and report["partition"] == "shards"
    assert report["samples"] == [total // 8] * 8
    assert [sum(row) for row in report["class_counts"]] == report["samples"]
    assert max(sum(c > 0 for c in row) for row in report["class_counts"]) <= 4  # 2 shards, each straddling at most 2
    assert (out / "partition.png").stat().st_size > 10_000


def test_fedsim_partition_refuses_a_bad_option_in_one_line(tmp_path, small_config, capsys):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(small_config))
    with pytest.raises(SystemExit) as info:
        main(
            [
                "partition",
                str(path),
                "--set",
                "data.partition=dirichlet",
                "--set",
                "data.alpha=-1",
                "--out",
                str(tmp_path / "out"),
            ]
        )
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("fedsim: error: --set data.alpha: must be > 0")
    assert not (tmp_path / "out").exists()  # refused before any data is loaded or file written
