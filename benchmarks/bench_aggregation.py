"""One evaluation of ByzFL's server pipeline, in fedsim and in ByzFL: clipping, NNM, then the rule.

    python benchmarks/bench_aggregation.py                       # 11 and 14 rows of 431,080 values
    python benchmarks/bench_aggregation.py --rows 11 --rules trimmed_mean --repeats 15
    python benchmarks/bench_aggregation.py --sort 14,64,128 --values 200000   # the sort alone

This is the step the optimal attacks repeat 20 times a round (their line search over the attack's
factor), so it sets the speed of ByzFL's benchmark (docs/robustness.md). Rows of ``--values``
numbers (431,080: ByzFL's ``cnn_mnist``, fedsim's ``byzfl_cnn``), ``--rows`` of them: 10 honest
updates plus f = rows - 10 Byzantine ones, drawn once from a seeded normal whose norms (about
3.3) the clipping (c = 2) cuts. fedsim: ``clipping`` (max_norm 2), ``nnm`` (f), then
``trimmed_mean`` (f) or ``geometric_median`` (eps 0.1, 3 iterations from zero, no tolerance).
ByzFL 0.0.11: ``Clipping(c=2)``, ``NNM(f)``, then ``TrMean(f)`` or ``GeometricMedian(nu=0.1,
T=3)``, the same functions (tests/test_aggregation.py checks them against each other). The two
are timed in turns, ``--repeats`` times each after a warm-up, on ``--threads`` torch threads;
the table gives the medians, their ratio and the largest difference between the two aggregates.
``--keep-freed-memory`` sets glibc to keep freed blocks for reuse, as fedsim does in a run's
processes (execution/resources.py), for both sides: a ByzFL run's process does not.
fedsim's side is timed as a long run goes, with its sorting network compiled (the trimmed mean's
sort; ``fedsim.fl.aggregation.compiled_network``); ``--uncompiled`` times it as a run's first
seconds go.
``--sort`` also times fedsim's sort of k rows (``sorted_rows``: a sorting network on a CPU up to
128 rows, which the trimmed mean and the median use), uncompiled and compiled, against
``torch.sort`` along the rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402 (benchmarks/ is not a package)

HONEST, CLIP = 10, 2.0
COLUMNS = [
    ("rows", "rows", "d"),
    ("f", "f", "d"),
    ("rule", "rule", ""),
    ("fedsim ms", "fedsim_ms", ".1f"),
    ("ByzFL ms", "byzfl_ms", ".1f"),
    ("ByzFL / fedsim", "ratio", ".2f"),
    ("max |diff|", "max_difference", ".1e"),
]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="11,14", help=f"updates per evaluation, comma-separated: {HONEST} + f")
    parser.add_argument("--values", type=int, default=431_080, help="numbers in an update (byzfl_cnn's)")
    parser.add_argument("--rules", default="trimmed_mean,geometric_median", help="comma-separated")
    parser.add_argument("--repeats", type=int, default=9, help="timed evaluations of each, in turns")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="glibc keeps freed blocks for reuse, as a fedsim run's processes do (both sides, one process)",
    )
    parser.add_argument(
        "--uncompiled", action="store_true", help="fedsim's sorting network uncompiled, as in a run's first seconds"
    )
    parser.add_argument("--sort", default="", help="also time the sort alone of these numbers of rows, comma-separated")
    parser.add_argument("--output", help="results JSON (default benchmarks/results/bench_aggregation-cpu-<time>.json)")
    return parser.parse_args(argv)


def pipelines(rule: str, f: int):
    """fedsim's evaluation and ByzFL's, each a function of the stacked updates."""
    from byzfl.aggregators import GeometricMedian, TrMean
    from byzfl.aggregators.preaggregators import NNM, Clipping

    from fedsim.fl.aggregation import AGGREGATORS, PRE_AGGREGATORS

    options = {"f": f} if rule == "trimmed_mean" else {"eps": 0.1, "max_iter": 3, "tol": 0, "init": "zero"}
    clip, nnm = PRE_AGGREGATORS.get("clipping")(max_norm=CLIP), PRE_AGGREGATORS.get("nnm")(f=f)
    ours_rule = AGGREGATORS.get(rule)(**options)
    theirs = [Clipping(c=CLIP), NNM(f=f), TrMean(f=f) if rule == "trimmed_mean" else GeometricMedian(nu=0.1, T=3)]

    def fedsim_side(updates: torch.Tensor) -> torch.Tensor:
        weights = torch.ones(len(updates))
        rows, weights = clip(updates, weights, None)
        rows, weights = nnm(rows, weights, None)
        return ours_rule(rows, weights)

    def byzfl_side(updates: torch.Tensor) -> torch.Tensor:
        rows = updates.clone()  # ByzFL's steps may work in place
        for step in theirs:
            rows = step(rows)
        return torch.as_tensor(rows)

    return fedsim_side, byzfl_side


def measure(rows: int, rule: str, args) -> dict:
    f = rows - HONEST
    updates = torch.randn(rows, args.values, generator=torch.Generator().manual_seed(rows)) * 0.005
    fedsim_side, byzfl_side = pipelines(rule, f)
    if rule == "trimmed_mean" and not args.uncompiled:
        compile_network(rows, args.values)
    ours, theirs = fedsim_side(updates), byzfl_side(updates)  # the warm-up, and the aggregates compared
    times = harness.in_turns(
        {"fedsim": lambda: fedsim_side(updates), "byzfl": lambda: byzfl_side(updates)}, args.repeats
    )
    fedsim_ms, byzfl_ms = (1e3 * statistics.median(times[name]) for name in ("fedsim", "byzfl"))
    return {
        "rows": rows,
        "f": f,
        "rule": rule,
        "fedsim_ms": fedsim_ms,
        "byzfl_ms": byzfl_ms,
        "ratio": byzfl_ms / fedsim_ms,
        "max_difference": float((ours.double() - theirs.double()).abs().max()),
        "times_s": times,
    }


SORT_COLUMNS = [
    ("rows", "rows", "d"),
    ("network ms", "network_ms", ".1f"),
    ("compiled ms", "compiled_ms", ".1f"),
    ("torch.sort ms", "torch_ms", ".1f"),
    ("torch.sort / network", "ratio", ".2f"),
    ("network / compiled", "compiled_ratio", ".2f"),
]


def compile_network(rows: int, values: int) -> None:
    """Compile fedsim's sorting network of ``rows`` rows, as a long run does, or stop."""
    from fedsim.fl.aggregation import compiled_network

    if compiled_network(rows, torch.zeros(rows, values)) is None:
        raise SystemExit(f"bench_aggregation: the sorting network of {rows} rows could not be compiled")


def measure_sort(rows: int, args) -> dict:
    """fedsim's sort of ``rows`` rows by its network, uncompiled (a run's first seconds) and compiled
    (up to 32 rows, as a run compiles it), against torch.sort, in turns; they must agree exactly."""
    from fedsim.fl.aggregation import _COMPILED_ROWS, compiled_network, network_sorted

    values = torch.randn(rows, args.values, generator=torch.Generator().manual_seed(rows))
    sides = {"network": lambda: network_sorted(values), "torch": lambda: values.sort(dim=0).values}
    if rows <= _COMPILED_ROWS:
        compile_network(rows, args.values)
        sides["compiled"] = lambda: compiled_network(rows, values)
    expected = sides["torch"]()
    for name, side in sides.items():
        if not torch.equal(side(), expected):
            raise AssertionError(f"{name} and torch.sort differ on {rows} rows")
    times = harness.in_turns(sides, args.repeats)
    ms = {name: 1e3 * statistics.median(times[name]) for name in sides}
    compiled_ms = ms.get("compiled", float("nan"))
    return {
        "rows": rows,
        "network_ms": ms["network"],
        "compiled_ms": compiled_ms,
        "torch_ms": ms["torch"],
        "ratio": ms["torch"] / ms["network"],
        "compiled_ratio": ms["network"] / compiled_ms,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import byzfl  # noqa: F401
    except ImportError:
        print("bench_aggregation: ByzFL is the other side; pip install byzfl==0.0.11", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    if args.keep_freed_memory:
        from fedsim.execution.resources import keep_freed_memory

        keep_freed_memory()
    machine = harness.machine_info()
    entries = [measure(int(k), rule, args) for k in args.rows.split(",") for rule in args.rules.split(",")]
    kept = ", freed memory kept" if args.keep_freed_memory else ""
    print(f"one evaluation, {args.values:,} values a row, {args.threads} thread(s), median of {args.repeats}{kept}")
    print(harness.format_table(COLUMNS, entries))
    sorts = [measure_sort(int(k), args) for k in args.sort.split(",") if k]
    if sorts:
        print(f"\nthe sort alone, {args.values:,} values a row")
        print(harness.format_table(SORT_COLUMNS, sorts))
    payload = {"entries": entries, "sorts": sorts}
    path = harness.write_results("bench_aggregation", args, machine, "cpu", [], payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
