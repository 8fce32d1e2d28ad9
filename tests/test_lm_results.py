"""A language model's run as its results show it: the round line, summary.json, History, the
figures and the sweep tables lead with test loss and perplexity, and call its accuracy token
accuracy; a classification run reads as it always has."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest
import yaml
from matplotlib.axes import Axes

import fedsim
from fedsim.cli import main
from fedsim.core.errors import FedsimError
from fedsim.experiment.config import Config
from fedsim.results.plot import accuracy_figure, plot_runs
from fedsim.results.progress import RoundLog
from fedsim.results.records import RoundRow
from fedsim.results.rundir import RunDirectory
from fedsim.runs.sweepruns import SweepRun, format_table, write_table

LOSSES = (4.0, 2.5, 2.75)  # the best perplexity is round 2's, not the last round's
TOKEN_ACCURACY = (0.10, 0.30, 0.28)


def round_row(rnd: int, loss: float, accuracy: float, tokens: bool, **changes) -> dict:
    """A round's row as the engine records it: a token run's perplexity is exp(test_loss)."""
    return RoundRow(
        round=rnd,
        test_accuracy=accuracy,
        test_loss=loss,
        test_perplexity=math.exp(loss) if tokens and not math.isnan(loss) else None,
        train_loss=loss + 0.25,
        seconds=1.5,
        elapsed_seconds=1.5 * rnd,
        clients=4,
        dropped_clients=0,
        attackers=0,
        train_seconds=1.0,
        worker_seconds=1.0,
        aggregate_seconds=0.1,
        eval_seconds=0.2,
        unavailable=0,
        stragglers=0,
        **changes,
    ).as_row()


def write_run_dir(path, name="lm", tokens=True, losses=LOSSES, accuracies=TOKEN_ACCURACY, seed=0):
    """A run directory written by the run's own writer: config.yaml, metrics.csv, summary.json."""
    rows = [round_row(r, loss, acc, tokens) for r, (loss, acc) in enumerate(zip(losses, accuracies), 1)]
    directory = RunDirectory.create(path)
    for row in rows:
        directory.append(row)
    directory.unlock()
    (path / "config.yaml").write_text(yaml.safe_dump(Config(name=name, seed=seed, device="cpu").to_dict()))
    directory.write_summary({"name": name, "status": "finished", "num_classes": 256 if tokens else 10})
    return path


# ----------------------------------------------------------------------------- the round line


def lines_of(rows, per_client="") -> list[str]:
    lines = []
    log = RoundLog(write=lines.append)
    log.per_client = per_client
    for row in rows:
        log.round_end(row, 10)
    return lines


def test_a_token_runs_line_leads_with_loss_and_perplexity():
    (line,) = lines_of([round_row(3, math.log(8.0), 0.25, tokens=True)])
    assert line == "round  3/10  test loss 2.0794  ppl 8.00  tok acc 0.2500  train loss 2.3294  1.50 s"


def test_an_unevaluated_round_of_a_token_run_reads_like_its_evaluated_ones():
    rows = [round_row(1, 3.0, 0.2, tokens=True), round_row(2, math.nan, math.nan, tokens=True)]
    assert rows[1]["test_perplexity"] is None  # as the engine leaves a round it does not evaluate
    unevaluated = lines_of(rows)[1]
    assert unevaluated.startswith("round  2/10  test loss    -    ppl    -    tok acc    -    train loss")


def test_personal_models_of_a_token_run_are_named_by_token_accuracy():
    row = round_row(1, math.log(20.0), 0.3, tokens=True, client_accuracy_mean=0.35)
    (line,) = lines_of([row], per_client="personal")
    assert "ppl 20.00  tok acc 0.3000  personal tok acc 0.3500  train loss" in line


def test_a_classification_line_is_as_it_was():
    row = round_row(2, 0.75, 0.875, tokens=False, client_accuracy_mean=0.5)
    assert lines_of([row]) == ["round  2/10  test acc 0.8750  test loss 0.7500  train loss 1.0000  1.50 s"]
    assert lines_of([row], per_client="personal") == [
        "round  2/10  test acc 0.8750  personal acc 0.5000  test loss 0.7500  train loss 1.0000  1.50 s"
    ]
    # eval_per_client scoring the global model (FedAvg): the mean over the clients' own test splits
    assert lines_of([row], per_client="client") == [
        "round  2/10  test acc 0.8750  client acc 0.5000  test loss 0.7500  train loss 1.0000  1.50 s"
    ]


def test_the_updating_display_of_a_token_run_shows_its_perplexity():
    stream = io.StringIO()
    log = RoundLog(progress=True, stream=stream)
    log.round_end(round_row(10, math.log(100.0), 0.5, tokens=True), 10)
    assert stream.getvalue() == (
        "\r[####################] round 10/10  test loss 4.6052  ppl 100.00  tok acc 0.5000  "
        "train loss 4.8552  1.50 s\n"
    )


# ----------------------------------------------------------------------------- summary.json


def test_summary_of_a_token_run_has_final_and_lowest_perplexity():
    from fedsim.runs.summary import outcome

    rows = [round_row(r, loss, acc, True) for r, (loss, acc) in enumerate(zip(LOSSES, TOKEN_ACCURACY), 1)]
    summary = outcome(rows, target=0.3)
    assert summary["final_test_perplexity"] == pytest.approx(math.exp(2.75), rel=1e-15)
    assert summary["best_test_perplexity"] == pytest.approx(math.exp(2.5), rel=1e-15)  # the lowest, round 2
    assert summary["final_test_accuracy"] == 0.28 and summary["best_test_accuracy"] == 0.30  # token accuracy
    assert summary["final_test_loss"] == 2.75 and summary["rounds_to_target"] == 2


def test_summary_of_a_classification_run_keeps_its_keys():
    from fedsim.runs.summary import outcome

    rows = [round_row(r, 1.0 - a, a, False) for r, a in enumerate((0.5, 0.7), 1)]
    assert outcome(rows, None) == {
        "rounds": 2,
        "test_samples": None,  # rows that do not say what they were scored on
        "final_test_accuracy": 0.7,
        "best_test_accuracy": 0.7,
        "final_test_loss": pytest.approx(0.3),
        "rounds_to_target": None,
    }
    assert set(outcome([], None)) == {
        "rounds",
        "test_samples",
        "final_test_accuracy",
        "best_test_accuracy",
        "final_test_loss",
        "rounds_to_target",
    }


# ----------------------------------------------------------------------------- History


def test_history_reads_the_perplexity_column_back(tmp_path):
    history = fedsim.load_run(write_run_dir(tmp_path / "lm"))
    assert history.tokens
    assert history.test_perplexity == [math.exp(loss) for loss in LOSSES]  # repr in the CSV: every bit kept
    assert history.final_perplexity == math.exp(2.75) and history.best_perplexity == math.exp(2.5)
    assert "final perplexity 15.64, token accuracy 0.2800" in repr(history)
    classification = fedsim.load_run(write_run_dir(tmp_path / "cls", tokens=False, accuracies=(0.5, 0.6, 0.7)))
    assert not classification.tokens and classification.test_perplexity == [None, None, None]
    assert classification.final_perplexity is None and classification.best_perplexity is None
    assert "final accuracy 0.7000" in repr(classification)


# ----------------------------------------------------------------------------- figures


def perplexity_axis(ax: Axes):
    (side,) = ax.child_axes  # matplotlib keeps a secondary axis among the axes' children
    return side


def test_a_token_runs_default_figure_is_its_loss_with_perplexity_on_the_right(tmp_path):
    fig = plot_runs(write_run_dir(tmp_path / "lm"))
    (ax,) = fig.axes
    assert list(ax.lines[0].get_ydata()) == list(LOSSES)
    assert ax.get_ylabel() == "test loss"
    side = perplexity_axis(ax)
    assert side.get_ylabel() == "test perplexity (log scale)"
    # the right-hand axis reads exp of the left one: the perplexity of every loss on the axis
    fig.draw_without_rendering()  # a secondary axis takes its limits from its parent's when drawn
    low, high = ax.get_ylim()
    assert side.get_ylim() == pytest.approx((math.exp(low), math.exp(high)), rel=1e-9)


def test_the_perplexity_metric_draws_on_a_log_axis(tmp_path):
    fig = plot_runs(write_run_dir(tmp_path / "lm"), metric="test_perplexity", loss=True)
    top, below = fig.axes[:2]
    assert top.get_yscale() == "log" and top.get_ylabel() == "test perplexity"
    assert list(top.lines[0].get_ydata()) == pytest.approx([math.exp(v) for v in LOSSES], rel=1e-12)
    assert below.get_ylabel() == "test token accuracy (%)"  # the loss is already drawn, as perplexity
    assert list(below.lines[0].get_ydata()) == pytest.approx([100 * a for a in TOKEN_ACCURACY])


def test_the_run_directorys_figure_of_a_token_run(tmp_path):
    history = fedsim.load_run(write_run_dir(tmp_path / "lm"))
    fig = accuracy_figure(history)
    loss_axis, accuracy_axis = [ax for ax in fig.axes if ax.get_ylabel()][:2]
    assert loss_axis.get_ylabel() == "test loss" and perplexity_axis(loss_axis)
    assert accuracy_axis.get_ylabel() == "test token accuracy (%)"
    # no chance line at 1 / 256 %: a vocabulary's chance says little of a language model
    assert all(len(line.get_ydata()) == len(LOSSES) for line in accuracy_axis.get_lines())


def test_token_accuracy_is_named_so_and_mixed_runs_draw_accuracy(tmp_path):
    lm = write_run_dir(tmp_path / "lm")
    other = write_run_dir(tmp_path / "lm2", name="lm2", losses=(3.0, 2.0, 1.5))
    assert plot_runs([lm, other]).axes[0].get_title().splitlines()[0] == "Test loss per round"
    title = plot_runs([lm, other], metric="test_accuracy").axes[0].get_title()
    assert title.splitlines()[0] == "Test token accuracy per round"
    classification = write_run_dir(tmp_path / "cls", name="cls", tokens=False)
    mixed = plot_runs([lm, classification])
    assert mixed.axes[0].get_ylabel() == "test accuracy (%)" and not mixed.axes[0].child_axes


def test_a_classification_run_has_no_perplexity_to_plot(tmp_path):
    classification = write_run_dir(tmp_path / "cls", tokens=False)
    with pytest.raises(FedsimError, match="has no test_perplexity values to plot; a language model's run"):
        plot_runs(classification, metric="test_perplexity")
    ax = plot_runs(classification).axes[0]
    assert ax.get_ylabel() == "test accuracy (%)" and not ax.child_axes


def test_the_plot_command_takes_the_perplexity_metric(tmp_path, capsys):
    run = write_run_dir(tmp_path / "lm")
    for extra, name in (([], "default.png"), (["--metric", "test_perplexity"], "ppl.png")):
        with pytest.raises(SystemExit) as done:
            main(["plot", str(run), "-o", str(tmp_path / name), *extra])
        assert done.value.code == 0 and (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    classification = write_run_dir(tmp_path / "cls", tokens=False)
    with pytest.raises(SystemExit) as done:
        main(["plot", str(classification), "-o", str(tmp_path / "no.png"), "--metric", "test_perplexity"])
    assert done.value.code == 2 and not (tmp_path / "no.png").exists()
    assert capsys.readouterr().err.count("\n") == 1


# ----------------------------------------------------------------------------- sweep tables


def sweep_runs(tmp_path, specs) -> list[SweepRun]:
    """(label, tokens, losses, accuracies, seed or None, configuration) -> finished sweep runs."""
    runs = []
    for label, tokens, losses, accuracies, seed, configuration in specs:
        history = fedsim.load_run(write_run_dir(tmp_path / label, label, tokens, losses, accuracies, seed or 0))
        cfg = Config(name=configuration, seed=seed or 0, device="cpu")
        runs.append(SweepRun(label, [("lr", label)], cfg, history, seed=seed, configuration=configuration))
    return runs


def table(text: str) -> list[list[str]]:
    return [line.split("  ") for line in text.splitlines()]


def test_a_sweep_of_token_runs_tables_perplexity_first(tmp_path):
    runs = sweep_runs(
        tmp_path,
        [
            ("a", True, (4.0, 2.5, 2.75), (0.1, 0.3, 0.28), None, "a"),
            ("b", True, (3.0, 2.0, 1.0), (0.2, 0.4, 0.5), None, "b"),
        ],
    )
    header, *rows = [[cell for cell in line if cell] for line in table(format_table(runs))]
    assert header == ["run", "final ppl", "best ppl", "final tok acc", "best tok acc", "s/round"]
    assert [c.strip() for c in rows[0][:5]] == ["a", "15.64", "12.18", "0.2800", "0.3000"]  # e^2.75, e^2.5
    assert [c.strip() for c in rows[1][:5]] == ["b", "2.72", "2.72", "0.5000", "0.5000"]  # e^1
    write_table(runs, tmp_path / "sweep.csv")
    with open(tmp_path / "sweep.csv", newline="") as f:
        written = list(csv.DictReader(f))
    assert float(written[0]["final_test_perplexity"]) == math.exp(2.75)
    assert float(written[0]["best_test_perplexity"]) == math.exp(2.5)


def test_over_seeds_the_perplexity_is_a_mean_and_sample_deviation(tmp_path):
    runs = sweep_runs(
        tmp_path,
        [
            ("x-seed=0", True, (3.0, math.log(10.0)), (0.1, 0.2), 0, "x"),
            ("x-seed=1", True, (3.0, math.log(20.0)), (0.1, 0.4), 1, "x"),
        ],
    )
    header, row = [[cell.strip() for cell in line if cell] for line in table(format_table(runs))]
    assert header[:4] == ["configuration", "seeds", "final ppl", "best ppl"]
    sd = math.sqrt(((10 - 15) ** 2 + (20 - 15) ** 2) / 1)  # sample deviation of 10 and 20
    assert row[2] == f"15.00 ± {sd:.2f}" and row[4] == f"0.3000 ± {math.sqrt(0.02):.4f}"
    write_table(runs, tmp_path / "sweep.csv")
    with open(tmp_path / "sweep.csv", newline="") as f:
        (written,) = csv.DictReader(f)
    assert float(written["final_test_perplexity"]) == pytest.approx(15.0, rel=1e-12)
    assert float(written["final_test_perplexity_std"]) == pytest.approx(sd, rel=1e-12)


def test_a_mixed_sweep_tables_as_a_classification_one(tmp_path):
    specs = [("a", True, LOSSES, TOKEN_ACCURACY, None, "a"), ("c", False, (1.0, 0.5, 0.4), (0.5, 0.8, 0.9), None, "c")]
    runs = sweep_runs(tmp_path, specs)
    header = [cell for cell in table(format_table(runs))[0] if cell]
    assert header == ["run", "final acc", "best acc", "s/round"]
    write_table(runs, tmp_path / "sweep.csv")
    with open(tmp_path / "sweep.csv", newline="") as f:
        columns = next(csv.reader(f))
    assert columns == ["run", "lr", "final_test_accuracy", "best_test_accuracy", "seconds_per_round", "rounds"]
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["num_classes"] == 10
