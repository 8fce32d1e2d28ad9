"""Figures of runs: lines, labels, panels, seed bands, axes, files; and the ``fedsim plot`` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from support import write_run

import fedsim
from fedsim.core.errors import FedsimError
from fedsim.results.plot import PALETTE, plot_runs, save_accuracy_plot, save_figure


def runs(tmp_path, specs):
    return [fedsim.load_run(write_run(tmp_path / f"run{i}", **spec)) for i, spec in enumerate(specs)]


def three_runs(tmp_path):
    return runs(
        tmp_path,
        [
            {"name": "fedavg", "accuracies": (0.3, 0.6, 0.8)},
            {"name": "median", "accuracies": (0.2, 0.5, 0.7), "settings": {"aggregator": "median", "data.alpha": 0.1}},
            {"name": "krum", "accuracies": (0.1, 0.4, 0.6), "settings": {"aggregator": "krum", "data.alpha": 0.5}},
        ],
    )


def legend_texts(fig: Figure) -> list[str]:
    return [t.get_text() for t in fig.legends[0].get_texts()] if fig.legends else []


def bands(ax) -> list[PolyCollection]:
    return [c for c in ax.collections if isinstance(c, PolyCollection)]


def test_overlaid_runs_one_line_each_labelled_by_name(tmp_path):
    fig = plot_runs(three_runs(tmp_path))
    (ax,) = fig.axes
    assert len(ax.lines) == 3 and bands(ax) == []
    assert legend_texts(fig) == ["fedavg", "median", "krum"]
    assert list(ax.lines[0].get_ydata()) == pytest.approx([30.0, 60.0, 80.0])  # accuracy in %
    assert ax.get_ylabel() == "test accuracy (%)" and ax.get_xlabel() == "round"
    # the title names the setting the runs share, and what varies among them
    assert ax.get_title().splitlines() == [
        "Test accuracy per round",
        "mnist (iid, 10 clients), model mnist_cnn, aggregator varies,",
        "algorithm fedavg; data.alpha varies",
    ]
    assert [line.get_color() for line in ax.lines] == list(PALETTE[:3])  # Okabe-Ito, colour-blind safe


def test_label_from_a_config_key_dotted_or_not(tmp_path):
    histories = three_runs(tmp_path)
    fig = plot_runs(histories, label="aggregator")
    assert legend_texts(fig) == ["fedavg", "median", "krum"]
    assert fig.legends[0].get_title().get_text() == "aggregator"
    # two lines would read "0.5": the key that tells them apart is added
    assert legend_texts(plot_runs(histories, label="data.alpha")) == [
        "0.5 (aggregator=fedavg)",
        "0.1",
        "0.5 (aggregator=krum)",
    ]
    with pytest.raises(FedsimError, match="^label data.nope: not a config key"):
        plot_runs(histories, label="data.nope")


def test_loss_panel_below(tmp_path):
    fig = plot_runs(three_runs(tmp_path), loss=True)
    top, bottom = fig.axes
    assert len(top.lines) == len(bottom.lines) == 3
    assert bottom.get_ylabel() == "test loss" and bottom.get_xlabel() == "round"
    assert list(bottom.lines[0].get_ydata()) == pytest.approx([1.7, 1.4, 1.2])


def test_seeds_of_one_experiment_become_a_mean_line_and_one_band(tmp_path):
    histories = runs(
        tmp_path,
        [
            {"name": "fedavg", "seed": 0, "accuracies": (0.2, 0.6)},
            {"name": "fedavg", "seed": 1, "accuracies": (0.4, 0.8)},
            {"name": "fedavg", "seed": 2, "accuracies": (0.3, 0.7)},
            {"name": "median", "seed": 0, "accuracies": (0.1, 0.5), "settings": {"aggregator": "median"}},
            {"name": "median", "seed": 1, "accuracies": (0.3, 0.5), "settings": {"aggregator": "median"}},
            {"name": "krum", "seed": 0, "accuracies": (0.1, 0.2), "settings": {"aggregator": "krum"}},
        ],
    )
    fig = plot_runs(histories, label="aggregator")
    (ax,) = fig.axes
    assert len(ax.lines) == 3 and len(bands(ax)) == 2
    assert list(ax.lines[0].get_ydata()) == pytest.approx([30.0, 70.0])
    low, high = band_limits(bands(ax)[0])
    assert low == pytest.approx([20.0, 60.0]) and high == pytest.approx([40.0, 80.0])
    assert legend_texts(fig) == ["fedavg", "median", "krum", "min–max over seeds"]

    fig = plot_runs(histories[:3], band="std")
    low, high = band_limits(bands(fig.axes[0])[0])
    assert low == pytest.approx([20.0, 60.0]) and high == pytest.approx([40.0, 80.0])  # s.d. of 20,40,30 is 10
    assert legend_texts(fig) == ["fedavg", "± 1 s.d. over 3 seeds"]

    assert len(plot_runs(histories, label="seed").axes[0].lines) == 6  # labelled by seed: nothing pooled


def band_limits(band: PolyCollection) -> tuple[list[float], list[float]]:
    """The lower and upper edge of a fill_between band, by x."""
    vertices = band.get_paths()[0].vertices
    xs = sorted(set(vertices[:, 0]))
    return ([min(y for x, y in vertices if x == v) for v in xs], [max(y for x, y in vertices if x == v) for v in xs])


def test_x_axis_in_seconds_and_integer_rounds(tmp_path):
    histories = three_runs(tmp_path)
    fig = plot_runs(histories, x="seconds")
    ax = fig.axes[0]
    assert list(ax.lines[0].get_xdata()) == [1.5, 3.0, 4.5] and ax.get_xlabel() == "wall time (s)"
    assert ax.get_title().splitlines()[0] == "Test accuracy over wall time"

    fig = plot_runs(histories)
    fig.canvas.draw()
    assert all(float(t).is_integer() for t in fig.axes[0].get_xticks())


def test_runs_from_directories_and_patterns(tmp_path):
    three_runs(tmp_path)
    fig = plot_runs([tmp_path / "run0", str(tmp_path / "run[12]")])
    assert legend_texts(fig) == ["fedavg", "median", "krum"]
    single = plot_runs(tmp_path / "run0")
    name, *described = single.axes[0].get_title().split("\n")
    assert single.legends == [] and name == "fedavg"  # the run's name, then what it ran
    assert " ".join(described) == "mnist (iid, 10 clients), model mnist_cnn, aggregator fedavg, algorithm fedavg"


def test_among_several_runs_a_failed_or_empty_one_is_left_out(tmp_path, caplog):
    three_runs(tmp_path)
    write_run(tmp_path / "run3", name="empty", accuracies=(), summary=False)
    failed = write_run(tmp_path / "run4", name="failed", accuracies=(0.1,))
    (failed / "summary.json").write_text('{"status": "failed", "error": "the disk is full"}')
    fig = plot_runs([str(tmp_path / "run*")])
    assert legend_texts(fig) == ["fedavg", "median", "krum"]
    assert f"{tmp_path / 'run3'}: left out; it has no evaluated round" in caplog.messages
    assert f"{failed}: left out; the run failed (the disk is full)" in caplog.messages
    alone = plot_runs(failed)  # on its own, a run is drawn as far as it got
    assert list(alone.axes[0].lines[0].get_ydata()) == [10.0]
    with pytest.raises(FedsimError, match="no evaluated rounds to plot yet"):
        plot_runs(tmp_path / "run3")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"metric": "accuracy"}, "metric: 'accuracy' is not one of"),
        ({"x": "time"}, "x: 'time' is not one of round, seconds"),
        ({"band": "iqr"}, "band: 'iqr'"),
        ({"width": "wide"}, "width: 'wide'"),
    ],
)
def test_bad_options_say_so(tmp_path, kwargs, message):
    with pytest.raises(FedsimError, match=message):
        plot_runs(three_runs(tmp_path), **kwargs)


def test_figure_sizes_for_a_paper(tmp_path):
    histories = three_runs(tmp_path)
    assert plot_runs(histories, width="single").get_figwidth() == 3.5
    assert plot_runs(histories, width="double").get_figwidth() == 7.0
    assert plot_runs(histories, width=5).get_figwidth() == 5


def test_save_figure_by_suffix_and_pdf_beside_png(tmp_path):
    fig = plot_runs(three_runs(tmp_path))
    out = tmp_path / "out"
    assert save_figure(fig, out / "a.png", pdf=True) == [out / "a.png", out / "a.pdf"]
    assert (tmp_path / "out" / "a.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "out" / "a.pdf").read_bytes()[:4] == b"%PDF"
    with pytest.raises(FedsimError, match="must end in .png or .pdf"):
        save_figure(fig, tmp_path / "a.jpg")


def test_save_accuracy_plot_keeps_its_signature(tmp_path):
    (history,) = runs(tmp_path, [{"name": "one"}])
    save_accuracy_plot(history, tmp_path / "accuracy.png")
    assert (tmp_path / "accuracy.png").read_bytes()[:4] == b"\x89PNG"


def fedsim_command(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fedsim", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_plot_command_writes_png_and_pdf(tmp_path):
    three_runs(tmp_path)
    done = fedsim_command(
        "plot", "run0", "run1", "run2", "--label", "aggregator", "--loss", "-o", "fig.png", "--pdf", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "fig.pdf").read_bytes()[:4] == b"%PDF"

    done = fedsim_command("plot", "run*", "--x", "seconds", "--width", "single", "-o", "figs/fig.pdf", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "figs" / "fig.pdf").read_bytes()[:4] == b"%PDF"


@pytest.mark.slow
def test_plot_command_on_a_non_run_directory_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    done = fedsim_command("plot", "empty", "-o", "fig.png", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == "fedsim: error: empty: not a run directory (no metrics.csv)\n"
    assert not (tmp_path / "fig.png").exists()


def test_legend_names_each_line_also_for_names_that_start_with_an_underscore(tmp_path):
    # matplotlib leaves "_"-labels out of its own legend handles; a rule from a notebook is one
    histories = runs(
        tmp_path,
        [
            {"name": "mine", "accuracies": (0.3, 0.6), "settings": {"aggregator": "__main__:my_rule"}},
            {"name": "avg", "accuracies": (0.2, 0.5), "settings": {"aggregator": "fedavg"}},
        ],
    )
    fig = plot_runs(histories, label="aggregator")
    assert legend_texts(fig) == ["__main__:my_rule", "fedavg"]
    handles = fig.legends[0].legend_handles
    assert [h.get_color() for h in handles] == list(PALETTE[:2])  # each text beside its own line


def test_runs_of_sweep_seeds_become_one_line_and_one_band_per_configuration(tmp_path):
    """The configs fedsim sweep --seeds gives its runs: the seeds of a grid point share its name,
    so the default legend (run names) pools them; the real command is in test_sweep.py."""
    from fedsim.results.history import History
    from fedsim.results.rundir import COLUMNS
    from fedsim.runs.sweep import plan

    (tmp_path / "base.yaml").write_text("name: cmp\nrounds: 2\ndata: {dataset: synthetic}\n")
    planned = plan(tmp_path / "base.yaml", ["aggregator=mean,median"], seeds="0,1,2")
    histories = [
        History(
            [
                dict.fromkeys(COLUMNS, 0.0)
                | {"round": r, "test_accuracy": 0.1 * (r + run.seed), "test_perplexity": None}
                for r in (1, 2)
            ],
            run.config.to_dict(),
        )
        for run in planned
    ]
    fig = plot_runs(histories, band="std")
    (ax,) = fig.axes
    assert len(ax.lines) == 2 and len(bands(ax)) == 2
    assert legend_texts(fig) == ["cmp-aggregator=mean", "cmp-aggregator=median", "± 1 s.d. over 3 seeds"]
    assert list(ax.lines[0].get_ydata()) == pytest.approx([20.0, 30.0])  # mean of 10, 20, 30 and 20, 30, 40
    low, high = band_limits(bands(ax)[0])
    assert low == pytest.approx([10.0, 20.0]) and high == pytest.approx([30.0, 40.0])


def with_columns(path, **columns):
    """Set columns of a written run's metrics.csv, one value per round (None: an empty cell)."""
    import csv

    with open(path / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = reader.fieldnames, list(reader)
    for i, row in enumerate(rows):
        row.update({key: "" if values[i] is None else repr(values[i]) for key, values in columns.items()})
    with open(path / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_spread_draws_the_clients_mean_a_deviation_band_and_the_tenth_percentile(tmp_path):
    path = with_columns(
        write_run(tmp_path / "run", name="per_client", accuracies=(0.3, 0.6, 0.8)),
        client_accuracy_mean=(0.25, 0.5, 0.7),
        client_accuracy_std=(0.1, 0.2, 0.4),
        client_accuracy_p10=(0.1, 0.2, 0.3),
    )
    fig = plot_runs(fedsim.load_run(path), spread=True)
    (ax,) = fig.axes
    mean, p10 = ax.lines
    assert list(mean.get_ydata()) == pytest.approx([25.0, 50.0, 70.0])
    assert list(p10.get_ydata()) == pytest.approx([10.0, 20.0, 30.0]) and p10.get_linestyle() == "--"
    (band,) = bands(ax)
    edges = band.get_paths()[0].vertices[:, 1]  # mean ± s.d., kept within 0 and 100 %
    assert min(edges) == pytest.approx(15.0) and max(edges) == pytest.approx(100.0)
    assert legend_texts(fig) == ["per_client", "± 1 s.d. over clients", "10th percentile of clients"]
    assert ax.get_ylabel() == "accuracy on each client's own test split (%)"


def test_spread_names_the_model_each_runs_clients_were_scored_with(tmp_path):
    for name, model, means in (("fedavg", "global", (0.11, 0.46)), ("ditto", "personal", (0.28, 0.58))):
        path = with_columns(
            write_run(tmp_path / name, name=name, accuracies=(0.12, 0.45)),
            client_accuracy_mean=means,
            client_accuracy_std=(0.1, 0.1),
            client_accuracy_p10=(0.05, 0.2),
        )
        summary = json.loads((path / "summary.json").read_text())
        (path / "summary.json").write_text(json.dumps({**summary, "client_eval_model": model}))
    fig = plot_runs([tmp_path / "fedavg", tmp_path / "ditto"], spread=True)
    assert legend_texts(fig)[:2] == ["fedavg (global model)", "ditto (own models)"]
    assert fig.axes[0].get_title().splitlines()[0] == "Accuracy on each client's own test split per round"
    means = [list(line.get_ydata()) for line in fig.axes[0].lines if line.get_linestyle() == "-"]
    assert means == [pytest.approx([11.0, 46.0]), pytest.approx([28.0, 58.0])]


def test_spread_and_epsilon_need_runs_that_have_them(tmp_path):
    path = with_columns(
        write_run(tmp_path / "run", accuracies=(0.3, 0.6)), epsilon=(None, None), client_accuracy_mean=(None, None)
    )
    history = fedsim.load_run(path)
    assert history.epsilon == [None, None] and history.client_accuracy_mean == [None, None]
    with pytest.raises(FedsimError, match="has no client_accuracy_mean values to plot; a run with eval_per_client"):
        plot_runs(history, spread=True)
    with pytest.raises(FedsimError, match="has no epsilon values to plot; a run with a privacy section"):
        plot_runs(history, x="epsilon")
    with pytest.raises(FedsimError, match="spread: draws the clients' accuracy; it does not combine with metric"):
        plot_runs(history, spread=True, metric="test_loss")
    with_columns(path, epsilon=(float("inf"), float("inf")))
    with pytest.raises(FedsimError, match="its epsilon is infinite"):
        plot_runs(fedsim.load_run(path), x="epsilon")


def test_accuracy_against_the_megabytes_sent(tmp_path):
    for seed in (0, 1):
        write_run(tmp_path / f"run{seed}", name=f"r{seed}", accuracies=(0.3, 0.6, 0.8))  # 1,500 bytes a round
    fig = plot_runs(fedsim.load_runs(tmp_path / "run*"), x="bytes")
    (ax,) = fig.axes
    assert list(ax.lines[0].get_xdata()) == pytest.approx([0.0015, 0.003, 0.0045])
    assert ax.get_xlabel() == "MB sent, up and down, since round 1"
    assert ax.get_title().splitlines()[0] == "Test accuracy against bytes sent"
    path = with_columns(tmp_path / "run0", cumulative_bytes=(None, None, None))  # hogwild's
    with pytest.raises(FedsimError, match="has no cumulative_bytes values to plot; every run counts them except"):
        plot_runs(fedsim.load_run(path), x="bytes")


@pytest.mark.slow
def test_accuracy_against_epsilon_and_the_spread_from_the_command(tmp_path):
    for i, z in enumerate((0.5, 1.0)):
        with_columns(
            write_run(tmp_path / f"run{i}", name=f"z{z}", accuracies=(0.3, 0.6)),
            epsilon=(4.0 / z, 6.0 / z),
            client_accuracy_mean=(0.2, 0.5),
            client_accuracy_std=(0.1, 0.1),
            client_accuracy_p10=(0.1, 0.3),
        )
    fig = plot_runs(fedsim.load_runs(tmp_path / "run*"), x="epsilon")
    assert [list(line.get_xdata()) for line in fig.axes[0].lines] == [[8.0, 12.0], [4.0, 6.0]]
    assert (
        fig.axes[0].get_xlabel().startswith("ε")
        and fig.axes[0].get_title().splitlines()[0] == "Test accuracy against ε"
    )
    done = fedsim_command("plot", "run*", "--x", "epsilon", "--spread", "-o", "fig.png", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"
    done = fedsim_command("plot", "run0", "--spread", "--metric", "test_loss", "-o", "no.png", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "spread:" in done.stderr


def test_facets_one_panel_per_value_with_each_line_in_one_colour(tmp_path):
    specs = []
    for attack in ("ipm", "alie"):
        for rule, base in (("median", 0.5), ("krum", 0.2)):
            for seed in (0, 1):
                accuracies = (base + 0.1 * seed, base + 0.2 + 0.1 * seed)
                settings = {"aggregator": rule, "attack.type": attack, "data.alpha": 0.3}
                specs.append({"name": "cmp", "seed": seed, "accuracies": accuracies, "settings": settings})
    fig = plot_runs(runs(tmp_path, specs), facet="attack.type", label="aggregator")
    left, right = [ax for ax in fig.axes if ax.get_visible()]
    assert (left.get_title(), right.get_title()) == ("attack.type=ipm", "attack.type=alie")
    for ax in (left, right):
        assert [line.get_color() for line in ax.lines] == list(PALETTE[:2])  # median, then krum, in each
        assert list(ax.lines[0].get_ydata()) == pytest.approx([55.0, 75.0])
        assert len(bands(ax)) == 2
    assert left.get_ylabel() == "test accuracy (%)" and right.get_ylabel() == ""
    assert legend_texts(fig) == ["median", "krum", "min–max over 2 seeds"]
    # the shared setting heads the figure; what the panels split is said to vary
    assert fig.get_suptitle().splitlines()[0] == "cmp"
    assert "aggregator varies" in fig.get_suptitle() and "data.alpha=0.3" not in fig.get_suptitle()


def test_facets_wrap_at_three_numbers_in_order_and_bands_lighten_with_many_lines(tmp_path):
    specs = [
        {
            "name": f"r{i}",
            "seed": seed,
            "accuracies": (0.1 * i, 0.1 * i + seed / 100),
            "settings": {"data.alpha": alpha},
        }
        for alpha in (1.0, 0.1, 0.5, 10.0)
        for i in range(8)
        for seed in (0, 1)
    ]
    fig = plot_runs(runs(tmp_path, specs), facet="data.alpha")
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in shown] == ["data.alpha=0.1", "data.alpha=0.5", "data.alpha=1", "data.alpha=10"]
    assert len(fig.axes) == 6  # two rows of three, the last two places empty
    assert len(shown[0].lines) == 8
    assert bands(shown[0])[0].get_alpha() == pytest.approx(0.1)  # 0.2 for up to four lines, then 0.2 * 4 / lines
    with pytest.raises(FedsimError, match="^facet data.nope: not a config key"):
        plot_runs(runs(tmp_path / "x", specs[:2]), facet="data.nope")


def test_plot_command_facets_by_a_swept_key(tmp_path):
    specs = [{"name": "s", "accuracies": (0.2, 0.4), "settings": {"aggregator": a}} for a in ("median", "krum")]
    dirs = [write_run(tmp_path / f"run{i}", **spec) for i, spec in enumerate(specs)]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedsim",
            "plot",
            *map(str, dirs),
            "-o",
            str(tmp_path / "f.png"),
            "--facet",
            "aggregator",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "f.png").stat().st_size > 0


def test_a_clustered_runs_clusters_are_drawn_and_other_runs_say_they_have_none(tmp_path):
    """metrics.csv's clusters: a line of whole numbers with --metric clusters, grey steps on a
    right-hand axis of the run's accuracy.png; a run without them is told so in one line."""
    from fedsim.results.plot import accuracy_figure

    clustered, plain = runs(tmp_path, [{"name": "cfl", "clusters": (1, 2, 4)}, {"name": "fedavg"}])
    (ax,) = plot_runs([clustered], metric="clusters").axes
    assert list(ax.lines[0].get_ydata()) == [1, 2, 4] and ax.get_ylabel() == "clusters"
    figure = accuracy_figure(clustered)
    side = next(axis for axis in figure.axes if axis.get_ylabel() == "clusters (dashed)")
    assert list(side.lines[0].get_xdata()) == [1, 2, 3] and list(side.lines[0].get_ydata()) == [1, 2, 4]
    assert all(axis.get_ylabel() != "clusters (dashed)" for axis in accuracy_figure(plain).axes)
    with pytest.raises(FedsimError, match="has no clusters values to plot; a run of a clustered algorithm"):
        plot_runs([plain], metric="clusters")


def ended(path, status, rounds):
    (path / "summary.json").write_text(json.dumps({"status": status, "rounds": rounds}))
    return path


def test_a_seed_stopped_by_stop_at_accuracy_is_held_at_its_last_accuracy(tmp_path, caplog):
    stop = {"stop_at_accuracy": 0.5, "rounds": 3}
    curves = {0: (0.26, 0.45, 0.64), 1: (0.30, 0.51), 2: (0.30, 0.44, 0.52)}  # seed 1 stops at round 2
    paths = [write_run(tmp_path / f"s{s}", seed=s, accuracies=a, settings=stop) for s, a in curves.items()]
    cut = ended(write_run(tmp_path / "int", seed=3, accuracies=(0.13,), settings=stop), "interrupted", 1)
    fig = plot_runs([*paths, cut])
    (line,) = fig.axes[0].lines
    assert list(line.get_xdata()) == [1, 2, 3]
    # round 3 counts seed 1's 51 % of round 2: its model did not change after it stopped
    expected = [(26 + 30 + 30) / 3, (45 + 51 + 44) / 3, (64 + 51 + 52) / 3]
    assert list(line.get_ydata()) == pytest.approx(expected)
    low, high = band_limits(bands(fig.axes[0])[0])
    assert (low[-1], high[-1]) == pytest.approx((51.0, 64.0))
    assert legend_texts(fig) == [
        "run",
        "min–max over 3 seeds; a seed stopped early (stop_at_accuracy) held at its last value",
    ]
    assert f"left out as unfinished, beside the runs that finished: {cut} (interrupted at round 1 of 3)" in (
        caplog.messages
    )
    # on the seconds axis a stopped seed spends no more time: round 3 is the mean of the two that ran it
    seconds = plot_runs(paths, x="seconds").axes[0].lines[0]
    assert list(seconds.get_ydata())[-1] == pytest.approx((64 + 52) / 2)
    assert list(seconds.get_xdata())[-1] == pytest.approx((1.5 * 3 + 0 + 1.5 * 3 + 2) / 2)  # elapsed 1.5 r + seed


def test_unfinished_runs_alone_are_drawn_and_marked(tmp_path):
    cut = ended(write_run(tmp_path / "int", name="cut", accuracies=(0.13,), settings={"rounds": 3}), "interrupted", 1)
    alone = plot_runs(cut)
    assert alone.axes[0].get_title().splitlines()[0] == "cut (interrupted at round 1 of 3)"
    other = ended(write_run(tmp_path / "int2", name="cut2", accuracies=(0.1, 0.2)), "interrupted", 2)
    assert legend_texts(plot_runs([cut, other])) == [
        "cut (interrupted at round 1 of 3)",
        "cut2 (interrupted at round 2 of 10)",
    ]


def test_labels_that_would_read_alike_get_the_keys_that_tell_them_apart(tmp_path):
    specs = []
    for attack, fraction in (("none", 0.0), ("sign_flip", 0.2)):
        for rule, optimizer in (("fedavg", "none"), ("fedavg", "fedadam"), ("median", "none")):
            settings = {
                "aggregator": rule,
                "server_optimizer": optimizer,
                "attack.type": attack,
                "attack.fraction": fraction,
            }
            specs.append({"name": "nb", "accuracies": (0.2, 0.4), "settings": settings})
    fig = plot_runs(runs(tmp_path, specs), label="aggregator")
    texts = legend_texts(fig)
    assert len(texts) == len(fig.axes[0].lines) == 6 == len(set(texts))
    assert len({line.get_color() for line in fig.axes[0].lines}) == 6
    assert "fedavg (attack.fraction=0.2, server_optimizer=fedadam)" in texts
    assert "median (attack.fraction=0)" in texts  # only the key that splits the medians


def test_a_run_scored_in_one_round_has_whole_round_ticks(tmp_path):
    specs = [{"name": n, "accuracies": (0.1,), "settings": {"aggregator": n}} for n in ("median", "krum")]
    fig = plot_runs(runs(tmp_path, specs), label="aggregator")
    fig.canvas.draw()
    ticks = [t for t in fig.axes[0].get_xticks() if fig.axes[0].get_xlim()[0] <= t <= fig.axes[0].get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)


def test_files_beside_runs_are_skipped_and_a_sweep_folder_gets_its_pattern(tmp_path, caplog):
    three_runs(tmp_path)
    (tmp_path / "runs.csv").write_text("run\n")
    fig = plot_runs([tmp_path / "run0", tmp_path / "run1", tmp_path / "runs.csv"])  # as the shell expands run*
    assert legend_texts(fig) == ["fedavg", "median"]
    assert f"left out, not run directories: {tmp_path / 'runs.csv'} (a file)" in caplog.messages
    with pytest.raises(FedsimError, match=r"runs.csv: not a run directory \(a file\)$"):
        plot_runs(tmp_path / "runs.csv")
    with pytest.raises(
        FedsimError,
        match=rf"^{tmp_path}: not a run directory \(no metrics.csv; it holds run "
        rf'directories, give "{tmp_path}/\*" for them\)$',
    ):
        plot_runs(tmp_path)
    with pytest.raises(FedsimError, match=r"^label aggregatr: not a config key of run 'fedavg' \(did you mean 'agg"):
        plot_runs(tmp_path / "run*", label="aggregatr")
    with pytest.raises(
        FedsimError, match=r"^facet attack.typ: .*\(did you mean 'attack.type'\?\); its keys: attack.count, attack.fra"
    ):
        plot_runs(tmp_path / "run*", facet="attack.typ")


def test_the_title_says_which_keys_outside_the_description_vary(tmp_path):
    specs = [
        {"name": "sw", "seed": seed, "settings": {"aggregator": rule, "attack.type": attack}}
        for rule in ("fedavg", "median")
        for attack in ("none", "sign_flip")
        for seed in (0, 1)
    ]
    title = " ".join(plot_runs(runs(tmp_path, specs), label="aggregator").axes[0].get_title().splitlines())
    assert "aggregator varies, algorithm fedavg; attack.type varies" in title


def test_runs_that_combine_their_updates_in_different_ways_say_the_aggregation_varies(tmp_path):
    """FedAvg, IFCA and FedProto share the config's aggregator (fedavg), not what they do with it."""
    histories = runs(
        tmp_path,
        [
            {"name": "fedavg", "settings": {"algorithm": "fedavg"}},
            {"name": "ifca", "settings": {"algorithm": "ifca"}},
            {"name": "fedproto", "settings": {"algorithm": "fedproto"}},
        ],
    )
    aggregations = ["fedavg", "fedavg within each of 4 clusters", "none: each client keeps its model; ..."]
    for history, aggregation in zip(histories, aggregations):
        history.summary["aggregation"] = aggregation
    title = " ".join(plot_runs(histories).axes[0].get_title().splitlines())
    assert "aggregation varies, algorithm varies" in title and "aggregator fedavg" not in title, title
    histories[1].summary["aggregation"] = histories[2].summary["aggregation"] = "fedavg"
    title = " ".join(plot_runs(histories).axes[0].get_title().splitlines())
    assert "aggregator fedavg, algorithm varies" in title, title
