"""eval_subset: quick runs score the rounds before the last on a seeded subset of the test set,
the same every round, and the last round on all of it."""

import logging

import pytest
import torch

import fedsim
from fedsim.engine.loop import evaluate
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
