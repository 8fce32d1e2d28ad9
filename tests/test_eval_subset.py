"""eval_subset: quick runs score the rounds before the last on a seeded subset of the test set,
the same every round, and the last round on all of it."""

import logging
from types import SimpleNamespace

import pytest
import torch

import fedsim
from fedsim.engine.loop import Engine, evaluate
from fedsim.engine.loop import test_subset as drawn_subset
from fedsim.experiment.validation import load_config

SUBSET = 300


def config(**overrides):
    return {
        "name": "subset",
        "seed": 3,
        "device": "cpu",
        "rounds": 3,
        "workers": 0,
        "clients_per_round": 2,
        "eval_subset": SUBSET,
        "data": {"dataset": "synthetic", "limit": 600, "num_clients": 4},
        **overrides,
    }


def test_the_subset_is_drawn_by_the_seed_in_test_set_order():
    x, y = torch.arange(1000.0)[:, None], torch.arange(1000)
    first, again = drawn_subset((x, y), SUBSET, 3), drawn_subset((x, y), SUBSET, 3)
    other = drawn_subset((x, y), SUBSET, 4)
    assert torch.equal(first[1], again[1]) and not torch.equal(first[1], other[1])
    kept = first[1]
    assert len(kept) == SUBSET == len(set(kept.tolist())) and bool((kept.diff() > 0).all())
    assert torch.equal(first[0][:, 0].long(), kept)  # inputs and labels stay paired
    assert drawn_subset((x, y), None, 3) is None and drawn_subset((x, y), 1000, 3) is None


@pytest.mark.slow
def test_rounds_before_the_last_are_scored_on_the_subset_and_the_last_on_everything(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # pytest's own would take fedsim's header
    history = fedsim.run(config(), out=tmp_path / "run")
    said = capsys.readouterr().out
    assert f"rounds before the last are scored on {SUBSET} of the 1,000 test samples" in said
    # an accuracy over 300 samples is a whole number of them; the last round's is over 1,000
    for accuracy in history.test_accuracy[:-1]:
        assert abs(accuracy * SUBSET - round(accuracy * SUBSET)) < 1e-9
    assert history.test_samples == [SUBSET, SUBSET, 1000]  # metrics.csv says which each round was scored on
    model = fedsim.load_model(history.run_dir)
    cfg = load_config(config())
    data = fedsim.data.load_dataset("synthetic", cfg.data.root, cfg.data.limit)
    accuracy, loss = evaluate(model, data.test_x, data.test_y, cfg.eval_batch_size)
    assert history.test_accuracy[-1] == accuracy and history.test_loss[-1] == loss


@pytest.mark.slow
def test_without_it_every_round_is_scored_on_the_whole_test_set(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    history = fedsim.run(config(eval_subset=None), out=tmp_path / "run")
    assert "eval_subset" not in capsys.readouterr().out
    assert history.test_samples == [1000, 1000, 1000]
    subset = fedsim.run(config(), out=tmp_path / "subset", quiet=True)
    assert history.test_accuracy[-1] == subset.test_accuracy[-1]  # training is the same either way
    assert history.train_loss == subset.train_loss


@pytest.mark.slow
def test_a_round_that_reaches_stop_at_accuracy_on_the_subset_is_scored_on_everything(tmp_path):
    """The run stops, and rounds_to_target counts, only on the whole test set's score: a round
    whose subset score reaches the target is scored again in full, as a last round is."""
    learns = {"rounds": 8, "clients_per_round": 4, "data": {"dataset": "synthetic", "limit": 2000, "num_clients": 4}}
    full = fedsim.run(config(**learns, eval_subset=None), out=tmp_path / "full", quiet=True)
    subset = fedsim.run(config(**learns), out=tmp_path / "subset", quiet=True)
    # a target that some round reaches on the subset while the whole test set scores it lower
    pairs = list(zip(subset.test_accuracy[:-1], full.test_accuracy[:-1]))
    target = next((s for s, f in pairs if s > f), None)
    assert target is not None, pairs  # the subset (300 of 1,000) scores some round higher
    stopped = fedsim.run(config(**learns, stop_at_accuracy=target), out=tmp_path / "stop", quiet=True)
    rounds = len(stopped.test_accuracy)
    reached_in_full = next((r for r, f in enumerate(full.test_accuracy, 1) if f >= target), None)
    assert rounds == (reached_in_full or 8) and rounds < 8  # it stops early, on the whole test set's score
    assert stopped.test_accuracy[-1] == full.test_accuracy[rounds - 1]  # scored on all of it
    assert stopped.summary["rounds_to_target"] == reached_in_full
    for r, (score, s, f) in enumerate(zip(stopped.test_accuracy, subset.test_accuracy, full.test_accuracy), 1):
        assert score == (f if s >= target or r == rounds else s), r  # training is the same in the three runs


def hint(rnd: int = 2, scoring: float = 6.0, training: float = 2.0, **settings) -> str | None:
    """The line offered after round ``rnd`` of 10, scored on all 1,305 test samples in ``scoring`` s."""
    engine = SimpleNamespace(cfg=load_config(config(rounds=10, eval_every=2, **{"eval_subset": None, **settings})))
    row = {"round": rnd, "test_samples": 1305, "eval_seconds": scoring, "train_seconds": training}
    return Engine.subset_hint(engine, row)


def test_a_run_whose_scoring_outlasts_its_training_is_offered_a_subset_that_would_take_as_long(tmp_path):
    line = hint()
    assert line == (
        "scoring all 1,305 test samples took 6.0 s of round 2, training 2.0 s: --set eval_subset=440 scores the "
        "rounds before the last on 440 samples drawn by the seed (the last round on all)"
    )  # 1,305 * 2 / 6 = 435, to two figures
    assert hint(scoring=1.9, training=0.5) and hint(scoring=0.9, training=0.1) is None  # a second or more
    assert hint(scoring=2.0, training=2.5) is None  # training takes longer
    assert hint(rnd=8) is None  # round 10 is the only one left to score, and on all samples anyway
    assert hint(eval_subset=100) is None
    # what it offers runs: the same run with the subset scores rounds before the last on 440 samples
    history = fedsim.run(config(rounds=2, eval_subset=440), out=tmp_path / "run", quiet=True)
    assert history.test_samples == [440, 1000]


def test_best_figures_and_rounds_to_target_compare_only_rounds_scored_on_the_whole_set():
    """With eval_subset, a round scored on a few samples can score above the last round's whole
    test set by chance: the best figures, the tables and rounds_to_target leave such rounds out
    and say the set they come from."""
    from fedsim.results.history import History, rounds_to_target
    from fedsim.results.table import results_table
    from fedsim.runs.summary import outcome

    rows = [  # the run: 0.2177 on 5 samples, 0.1888 on all 216
        {
            "round": 1,
            "test_accuracy": 0.2,
            "test_loss": 3.1,
            "test_perplexity": 22.2,
            "test_samples": 5,
            "seconds": 1.0,
        },
        {
            "round": 2,
            "test_accuracy": 0.2177,
            "test_loss": 3.0,
            "test_perplexity": 20.1,
            "test_samples": 5,
            "seconds": 1.0,
        },
        {
            "round": 3,
            "test_accuracy": 0.15,
            "test_loss": 3.2,
            "test_perplexity": 24.5,
            "test_samples": 216,
            "seconds": 1.0,
        },
        {
            "round": 4,
            "test_accuracy": 0.1888,
            "test_loss": 3.3,
            "test_perplexity": 27.1,
            "test_samples": 216,
            "seconds": 1.0,
        },
    ]
    summary = outcome(rows, target=0.16)
    assert (summary["best_test_accuracy"], summary["best_test_perplexity"]) == (0.1888, 24.5)
    assert summary["test_samples"] == 216 and summary["rounds_to_target"] == 4  # round 1 reached it on 5 samples
    history = History(rows, {"name": "lm", "stop_at_accuracy": 0.16}, summary={"wall_seconds": 1.0})
    assert (history.best_accuracy, history.best_perplexity, history.scored_on) == (0.1888, 24.5, 216)
    assert history.scored_apart and rounds_to_target(history, 0.16) == 4
    table = results_table([history])
    assert table[0]["best_accuracy"] == 0.1888 and table[0]["rounds_to_target"] == 4
    assert "scored on" in table.markdown().splitlines()[0] and "216 samples" in table.markdown()
    whole = History([{**row, "test_samples": 216} for row in rows], {"name": "all"}, summary={"wall_seconds": 1.0})
    assert whole.best_accuracy == 0.2177 and not whole.scored_apart
    assert "scored on" not in results_table([whole]).markdown()  # every round on one set: nothing to say
    # round 0, a fine-tuning run's base, is scored but trained nothing: no best figure, no round to a target
    base = {"round": 0, "test_accuracy": 0.3, "test_loss": 2.4, "test_perplexity": 11.3, "test_samples": 216}
    tuned = [base, *whole.rows[2:]]
    summary = outcome(tuned, target=0.16)
    assert (summary["best_test_accuracy"], summary["best_test_perplexity"], summary["rounds_to_target"]) == (
        0.1888,
        24.5,
        4,
    )
    fine_tuned = History(tuned, {"name": "tuned"}, summary={"wall_seconds": 1.0})
    assert fine_tuned.best_accuracy == 0.1888 and rounds_to_target(fine_tuned, 0.16) == 4
    assert not fine_tuned.scored_apart
    # a sweep's table and sweep.csv likewise
    from fedsim.runs.sweepruns import SweepRun, _row, format_table

    runs = [SweepRun(h.name, [], load_config({"name": h.name}), h) for h in (history, whole)]
    header, *lines = format_table(runs).splitlines()
    assert " ".join(header.split()) == "run final ppl best ppl final tok acc best tok acc scored on s/round"
    assert lines[0].split()[:7] == ["lm", "27.10", "24.50", "0.1888", "0.1888", "216", "samples"]
    assert lines[1].split()[:7] == ["all", "27.10", "20.10", "0.1888", "0.2177", "216", "samples"]
    assert _row(runs[0], None, runs)["test_samples"] == 216
