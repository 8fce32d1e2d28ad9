"""benchmarks/bench_lm.py: the tokens it counts per client, and a --quick run end to end."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench_lm(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_lm

    return bench_lm


def batched_tokens(samples: int, steps: int, batch_size: int, sequence_length: int) -> int:
    """What a client's local loop feeds: a shuffled epoch split into batches, epoch after epoch,
    cut after ``steps`` batches."""

    def batches():
        while True:
            yield from torch.randperm(samples).split(batch_size)

    return sum(len(batch) for batch in itertools.islice(batches(), steps)) * sequence_length


@pytest.mark.parametrize(
    "samples, steps, batch_size",
    [(31, 2, 8), (31, 4, 8), (31, 5, 8), (31, 9, 8), (32, 4, 8), (32, 6, 8), (3, 1, 8), (3, 4, 8), (1, 1, 1)],
)
def test_tokens_per_client_follow_the_local_batches(bench_lm, samples, steps, batch_size):
    expected = batched_tokens(samples, steps, batch_size, 64)
    assert bench_lm.tokens_per_client(samples, steps, batch_size, 64) == expected


def test_tokens_per_second_count_the_rounds_after_the_first(bench_lm):
    rows = [{"round": r, "train_seconds": s, "seconds": s + 1} for r, s in ((1, 9.0), (2, 2.0), (3, 4.0))]
    clients = [{"round": r, "samples": n, "steps": 2} for r in (1, 2, 3) for n in (31, 5)]
    result = bench_lm.throughput({"rows": rows, "clients": clients}, batch_size=8, sequence_length=10)
    per_round = (16 + 10) * 10  # 31 samples: two batches of 8; 5 samples: the whole epoch twice
    assert result["tokens_per_round"] == per_round
    assert result["tokens_per_second"] == pytest.approx(2 * per_round / 6.0)
    assert result["train_seconds"] == 3.0 and result["measured_rounds"] == 2


def test_the_comparison_sets_each_worker_counts_shared_base_against_its_copies(bench_lm):
    entries = [
        {"kind": kind, "workers": w, "status": "ok", "all_mb": mb, "frozen_base_mb": 100.0, "tokens_per_second": t}
        for kind, w, mb, t in (("shared", 1, 900.0, 10.0), ("copies", 1, 1010.0, 9.0), ("shared", 2, 1000.0, 18.0))
    ] + [{"kind": "copies", "workers": 2, "status": "failed"}, {"kind": "sequential", "workers": 1, "status": "ok"}]
    assert bench_lm.comparison(entries) == [
        {
            "workers": 1,
            "shared_mb": 900.0,
            "copies_mb": 1010.0,
            "difference_mb": 110.0,
            "expected_mb": 100.0,
            "shared_tokens_per_second": 10.0,
            "copies_tokens_per_second": 9.0,
        }
    ]


def test_each_kind_runs_the_same_experiment_on_its_backend_with_its_base(bench_lm):
    args = bench_lm.parse_args(["--quick", "--device", "cpu"])
    specs = {
        kind: bench_lm.child_spec(args, "cpu", kind, 2, 4 if kind == "batched" else None, None)
        for kind in bench_lm.KINDS[1:]
    }
    configs = {kind: spec["config"] for kind, spec in specs.items()}
    assert {kind: c["lora"]["share_base"] for kind, c in configs.items()} == {
        "copies": False,
        "shared": True,
        "batched": True,
    }
    assert {kind: c.get("backend", "process") for kind, c in configs.items()} == {
        "copies": "process",
        "shared": "process",
        "batched": "vmap",
    }
    assert configs["batched"]["vmap_group_size"] == 4
    apart = ("name", "lora", "backend", "vmap_group_size")
    same = [{k: v for k, v in c.items() if k not in apart} for c in configs.values()]
    assert same[0] == same[1] == same[2] and same[0]["workers"] == 2


@pytest.mark.slow
def test_quick_run_measures_the_sequential_loop_and_batched_adapters_on_a_shared_base(tmp_path):
    output = tmp_path / "lm.json"
    command = [sys.executable, str(REPO / "benchmarks" / "bench_lm.py"), "--quick"]
    command += ["--device", "cpu", "--data-root", str(tmp_path), "--output", str(output)]  # no texts: generated
    # the shared base and a copy per worker are fedsim runs as the batched adapters are, on the
    # process backend: their configurations and their comparison are checked by the tests above
    command += ["--kinds", "sequential,batched"]
    env = {k: v for k, v in os.environ.items() if k != "FEDSIM_DATA"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(output.read_text())
    sequential, batched = result["entries"]
    assert [e["kind"] for e in result["entries"]] == ["sequential", "batched"]
    assert batched["group"] == 4 and batched["backend"] == "vmap"
    # 8 clients a round, each 1 step of 8 full sequences of 64 tokens (every generated client has more)
    assert sequential["status"] == "ok" and sequential["tokens_per_round"] == 8 * 8 * 64
    assert sequential["to_sequential"] == 1 and sequential["all_mb"] > 0
    assert batched["status"] == "ok" and batched["data"] == "generated" and batched["measured_rounds"] == 1
    assert batched["tokens_per_round"] == 8 * 8 * 64 and batched["tokens_per_second"] > 0
    assert len(batched["worker_mb"]) == 1 and batched["frozen_base_mb"] > 0
    assert batched["all_mb"] == pytest.approx(batched["server_mb"] + sum(batched["worker_mb"]))
    assert batched["to_sequential"] == pytest.approx(batched["tokens_per_second"] / sequential["tokens_per_second"])
    assert result["comparison"] == []  # no copies measured: nothing to compare


def test_replot_draws_the_figure_of_a_results_file_with_a_bar_per_measured_kind(bench_lm, tmp_path):
    entries = [
        {"kind": "sequential", "workers": 1, "group": "", "status": "ok", "tokens_per_second": 100.0},
        {"kind": "shared", "workers": 2, "group": "", "status": "ok", "tokens_per_second": 80.0},
        {"kind": "batched", "workers": 2, "group": 4, "status": "ok", "tokens_per_second": 90.0},
        {"kind": "copies", "workers": 4, "group": "", "status": "failed", "tokens_per_second": None},
    ]
    machine = {"device_name": "a CPU", "torch": "2.x", "load_average_start": [0.5], "load_average_end": [1.0]}
    results = tmp_path / "bench_lm.json"
    results.write_text(json.dumps({"entries": entries, "machine": machine}))
    assert bench_lm.main(["--replot", str(results)]) == 0
    from PIL import Image

    with Image.open(tmp_path / "bench_lm.png") as image:
        assert image.size[0] > 200 and image.size[1] > 200
