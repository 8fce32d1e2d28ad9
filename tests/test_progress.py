"""The one-line round display: on, off, automatic; the rows it is given and the other lines."""

from __future__ import annotations

import io

import pytest

from fedsim.results.progress import RoundLog, format_duration


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def row(rnd: int, accuracy: float = 0.5, **changes) -> dict:
    """A round's metrics row, as the server hands it over."""
    return {
        "round": rnd,
        "test_accuracy": accuracy,
        "test_loss": 1.0,
        "train_loss": 1.2,
        "seconds": 2.0,
        "elapsed_seconds": 2.0 * rnd,
        "clients": 4,
        "dropped_clients": 0,
        "attackers": 0,
        **changes,
    }


def test_off_prints_every_line_as_it_comes():
    out = io.StringIO()
    log = RoundLog(False, stream=out)
    log("start")
    log.round_end(row(1), 2)
    log.round_end(row(2, accuracy=float("nan"), dropped_clients=1), 2)
    assert out.getvalue() == (
        "start\n"
        "round 1/2  test acc 0.5000  test loss 1.0000  train loss 1.2000  2.00 s\n"
        "round 2/2  test acc    -    test loss 1.0000  train loss 1.2000  2.00 s  dropped 1\n"
    )


def test_a_round_with_no_training_says_why_it_has_no_train_loss():
    lines = []
    log = RoundLog(write=lines.append)
    log.round_end(row(0, train_loss=float("nan")), 2)  # an initial_weights run's base
    log.round_end(row(1, train_loss=float("nan"), clients=0, unavailable=4), 2)  # everyone offline
    log.round_end(row(2, unavailable=3), 2)
    assert lines == [
        "round 0/2  test acc 0.5000  test loss 1.0000  before training  2.00 s",
        "round 1/2  test acc 0.5000  test loss 1.0000  train loss    -    2.00 s  unavailable 4"
        "  no client's work counted",
        "round 2/2  test acc 0.5000  test loss 1.0000  train loss 1.2000  2.00 s  unavailable 3",
    ]


def test_a_round_scored_nan_shows_nan_where_an_unscored_one_shows_a_dash():
    lines = []
    log = RoundLog(write=lines.append)
    log.round_end(row(1, test_loss=float("nan"), test_samples=200), 2)  # scored: the model gave NaN
    log.round_end(row(2, accuracy=float("nan"), test_loss=float("nan")), 2)  # not evaluated
    assert lines == [
        "round 1/2  test acc 0.5000  test loss nan  train loss 1.2000  2.00 s",
        "round 2/2  test acc    -    test loss    -    train loss 1.2000  2.00 s",
    ]


def test_a_function_may_take_the_lines():
    lines = []
    log = RoundLog(write=lines.append)
    log("start")
    log.round_end(row(3), 10)
    assert lines == ["start", "round  3/10  test acc 0.5000  test loss 1.0000  train loss 1.2000  2.00 s"]


def test_on_rounds_share_one_line_with_a_bar_and_time_left():
    out, clock = io.StringIO(), Clock()
    log = RoundLog(True, stream=out, clock=clock)
    log("demo: 4 rounds of 2/4 clients")
    for rnd in (1, 2, 3, 4):
        log.round_end(row(rnd, accuracy=0.1 * rnd), 4)
        clock.now += 10.0
    text = out.getvalue()
    start, rest = text.split("\n", 1)
    assert start == "demo: 4 rounds of 2/4 clients"
    assert rest.endswith("\n") and rest.count("\n") == 1  # the last round ends the line
    updates = rest.rstrip("\n").split("\r")[1:]
    assert len(updates) == 4
    assert updates[0].startswith("[#####...............] round 1/4  test acc 0.1000")
    assert "left" not in updates[0]  # the first round includes start-up; no pace yet
    assert updates[1].rstrip().endswith("~20 s left")  # 10 s a round, two rounds to go
    assert updates[3].startswith("[####################] round 4/4  test acc 0.4000")
    assert "left" not in updates[3]


def test_a_shorter_update_blanks_the_rest_of_the_longer_one():
    out = io.StringIO()
    log = RoundLog(True, stream=out)
    log.round_end(row(1, dropped_clients=12345678), 3)
    log.round_end(row(2), 3)
    first, second = out.getvalue().split("\r")[1:]
    assert len(second) == len(first) and second.rstrip().endswith("left") and "dropped" not in second


def test_other_lines_end_the_progress_line_first():
    out = io.StringIO()
    log = RoundLog(True, stream=out)
    log.round_end(row(1), 9)
    log("reached stop_at_accuracy 0.5 in round 1")
    log("round 1: worker 0 died; restarting the workers")  # not a round line: no "/total"
    lines = out.getvalue().split("\n")
    assert lines[0].startswith("\r[") and lines[1] == "reached stop_at_accuracy 0.5 in round 1"
    assert lines[2] == "round 1: worker 0 died; restarting the workers" and lines[3] == ""


def test_automatic_is_on_for_a_terminal_only():
    assert RoundLog(stream=io.StringIO()).enabled() is False
    assert RoundLog(stream=Terminal()).enabled() is True
    assert RoundLog(False, stream=Terminal()).enabled() is False


def test_writes_to_sys_stdout_as_it_is_at_each_call(capsys):
    log = RoundLog(True)
    log.round_end(row(1), 1)
    assert capsys.readouterr().out.startswith("\r[####################] round 1/1")


def test_cut_to_the_terminal_width_keeping_the_time_left(monkeypatch):
    monkeypatch.setattr("shutil.get_terminal_size", lambda: type("Size", (), {"columns": 61})())
    out, clock = Terminal(), Clock()
    log = RoundLog(stream=out, clock=clock)
    log.round_end(row(1), 3)
    clock.now += 5.0
    log.round_end(row(2), 3)
    first, second = out.getvalue().split("\r")[1:]
    assert len(first.rstrip()) == 60 and first.rstrip().endswith("...")
    assert len(second) == 60 and second.startswith("[#############.......] round 2/3  test acc")
    assert second.endswith("...  ~5 s left")


@pytest.mark.parametrize("seconds, text", [(4.4, "4 s"), (65, "1 min 05 s"), (3725, "1 h 02 min")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.slow
def test_a_run_with_progress_shows_one_line(tmp_path, capsys, monkeypatch):
    import logging

    import fedsim

    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # pytest's own would take fedsim's messages

    cfg = {
        "name": "p",
        "seed": 0,
        "device": "cpu",
        "rounds": 3,
        "workers": 0,
        "clients_per_round": 2,
        "data": {"dataset": "synthetic", "limit": 600, "num_clients": 4},
    }
    fedsim.run(cfg, out=tmp_path / "run", progress=True)
    out = capsys.readouterr().out
    what, starting, header, rounds, rest = out.split("\n", 4)
    assert what == "p: synthetic (iid, 4 clients), model mnist_cnn, aggregator fedavg, algorithm fedavg"
    assert starting == "loading synthetic on cpu"  # said before the data loads
    assert header.startswith("p: 3 rounds") and rest == ""
    assert rounds.count("\r") == 3 and rounds.rstrip().split("\r")[-1].startswith("[####################] round 3/3")


def test_a_round_whose_scoring_takes_a_good_part_of_it_says_how_much():
    out = io.StringIO()
    log = RoundLog(False, stream=out)
    log.round_end(row(1, eval_seconds=0.4), 2)  # a fifth of the round: not worth a word
    log.round_end(row(2, eval_seconds=1.5, test_samples=3925), 2)  # and on how many samples
    log.round_end(row(2, eval_seconds=1.5), 2)  # a row of an older version, without test_samples
    assert out.getvalue().splitlines() == [
        "round 1/2  test acc 0.5000  test loss 1.0000  train loss 1.2000  2.00 s",
        "round 2/2  test acc 0.5000  test loss 1.0000  train loss 1.2000  2.00 s (1.50 s scoring 3,925 test samples)",
        "round 2/2  test acc 0.5000  test loss 1.0000  train loss 1.2000  2.00 s (1.50 s scoring)",
    ]
