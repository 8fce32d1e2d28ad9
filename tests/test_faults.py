"""Faults of the machine and of the files around a run: one line naming the path and what to
do, exit status 2 (bad input) or 1 (environment), no traceback, no temporary or half-written
file, no process left behind, the diagnosis of the actual cause."""

from __future__ import annotations

import errno
import gzip
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from support import TESTS_DIR, assert_one_line_error, fork_server_of, run_cli, start, tagged_processes, wait_for_round

import fedsim
from fedsim.cli import main
from fedsim.core.errors import resource_hint
from fedsim.results.rundir import RunDirectory, safe_dir_name

BASE = {
    "name": "faults",
    "seed": 2,
    "device": "cpu",
    "rounds": 2,
    "workers": 0,
    "clients_per_round": 2,
    "data": {"dataset": "synthetic", "num_clients": 4, "limit": 1200},
    "local": {"lr": 0.05, "batch_size": 64},
}


def write_config(tmp_path, name="exp.yaml", **changes) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**BASE, **changes}))
    return path


def cli(capsys, *args) -> tuple[int, str]:
    """Run the command in this process; its exit status and stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    return exit_info.value.code, capsys.readouterr().err


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A run directory of one round, made once for the tests that damage a copy of it."""
    path = tmp_path_factory.mktemp("finished") / "run"
    fedsim.run(BASE, out=path, quiet=True, rounds=1)
    return path


def copy_of(finished: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(finished, tmp_path / "run"))


def leftovers(folder: Path) -> list[str]:
    """Temporary files left in a folder: none may survive a failed write."""
    return [p.name for p in folder.rglob("*.tmp")] if folder.exists() else []


# ----------------------------------------------------------------------------- output paths


def test_an_output_path_below_a_regular_file_is_refused_by_every_command(tmp_path, capsys, finished):
    config = write_config(tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    for args in (
        ["run", config, "--out", blocker / "run"],
        ["partition", config, "--out", blocker / "part"],
        ["sweep", config, "--grid", "seed=0,1", "--out", blocker / "sweep"],
        ["plot", finished, "-o", blocker / "fig.png"],
    ):
        code, err = cli(capsys, *args)
        assert code == 2 and err.count("\n") == 1, (args, err)
        assert f"{blocker} is a file, not a directory" in err, err
    assert blocker.read_text() == "not a directory"


def test_a_name_too_long_for_the_file_system_is_refused(tmp_path, capsys):
    code, err = cli(capsys, "run", write_config(tmp_path), "--out", tmp_path / ("x" * 300))
    assert code == 2 and "a name in it is longer than 255 bytes" in err and err.count("\n") == 1


@pytest.mark.parametrize("name", ["../../escape", "/etc/escape", "a/b/../../c", ".hidden", "x" * 400, "ünï cödé"])
def test_run_directories_stay_inside_runs(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = RunDirectory.target(None, name)
    assert path.parent == Path("runs") and len(path.name) <= 140 and not path.name.startswith(".")
    assert "/" not in safe_dir_name(name) and safe_dir_name(name) != safe_dir_name(name + "y")


@pytest.mark.slow
def test_a_run_named_like_a_path_writes_inside_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    history = fedsim.run(BASE, quiet=True, rounds=1, name="../../escape")
    assert history.run_dir.resolve().parent == (tmp_path / "runs").resolve()
    assert history.name == "../../escape"  # the name itself is kept for titles and tables
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


# ----------------------------------------------------------------------------- failed writes


@pytest.mark.slow
@pytest.mark.parametrize(
    "target, code, words",
    [
        ("checkpoint.pt", 1, "the disk is full"),
        ("metrics.csv", 1, "the file system is read-only"),
        ("config.yaml", 1, "permission denied"),
    ],
)
def test_a_failed_write_is_one_line_and_leaves_no_temporary_file(tmp_path, capsys, monkeypatch, target, code, words):
    import fedsim.results.rundir

    causes = {"checkpoint.pt": errno.ENOSPC, "metrics.csv": errno.EROFS, "config.yaml": errno.EACCES}
    real = os.replace

    def failing(src, dst):
        if Path(dst).name == target and Path(dst).parent.name == "run":
            raise OSError(causes[target], os.strerror(causes[target]))
        return real(src, dst)

    monkeypatch.setattr(fedsim.results.rundir.os, "replace", failing)
    status, err = cli(capsys, "run", write_config(tmp_path), "--out", tmp_path / "run")
    assert status == code, err
    assert_one_line_error(err, f"cannot write {tmp_path / 'run' / target}: {words}", "choose another place with --out")
    assert leftovers(tmp_path) == []


def _in_private_mount(script: str) -> subprocess.CompletedProcess:
    """Run a shell script in a private mount namespace (so it can mount a small tmpfs)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("needs unshare -m (root in a Linux mount namespace) to mount a small file system")
    env = {**os.environ, "PYTHONPATH": str(Path(fedsim.__file__).parents[1])}
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.slow
def test_a_full_disk_is_named_as_such_and_keeps_files_whole(tmp_path):
    config = write_config(tmp_path)
    mount = tmp_path / "small"
    mount.mkdir()
    # room for the config and the metrics, not for a checkpoint (about 90 kB of weights)
    done = _in_private_mount(f"""
        mount -t tmpfs -o size=48k tmpfs {mount}
        {sys.executable} -m fedsim run {config} --out {mount}/run --no-progress
        echo "status $?"
        ls -A {mount}/run
        cat {mount}/run/metrics.csv
    """)
    assert "status 1" in done.stdout, done
    assert_one_line_error(done.stderr, f"cannot write {mount}/run/checkpoint.pt: the disk is full")
    assert len(done.stderr.splitlines()) == 1  # said once: no warning that the summary failed too
    assert "shared memory" not in done.stderr
    listing = done.stdout.split("status 1")[1]
    assert ".tmp" not in listing and "checkpoint.pt" not in listing
    assert "round,test_accuracy" in listing  # the metrics file is whole (a header, no half row)


@pytest.mark.slow
def test_a_read_only_output_is_named_as_such(tmp_path):
    config = write_config(tmp_path)
    mount = tmp_path / "ro"
    mount.mkdir()
    done = _in_private_mount(f"""
        mount -t tmpfs -o size=1m,ro tmpfs {mount}
        {sys.executable} -m fedsim run {config} --out {mount}/run
        echo "status $?"
    """)
    assert "status 1" in done.stdout, done
    assert_one_line_error(done.stderr, f"cannot write {mount}/run: the file system is read-only")


# ----------------------------------------------------------------------------- data files


def _fake_mnist(root: Path, train: int = 40, test: int = 10) -> Path:
    """IDX archives in torchvision's layout, small and valid."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", train), ("t10k", test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            header = (0x0800 | array.ndim).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
            with gzip.open(raw / f"{prefix}-{kind}-ubyte.gz", "wb") as f:
                f.write(header + array.tobytes())
    return raw


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _random_bytes(path: Path) -> None:
    path.write_bytes(np.random.default_rng(1).bytes(500))


def _wrong_magic(path: Path) -> None:
    with gzip.open(path, "wb") as f:
        f.write(b"\x00\x00\x0d\x01" + bytes(100))


def _short_labels(path: Path) -> None:
    with gzip.open(path, "wb") as f:
        f.write((0x0801).to_bytes(4, "big") + (7).to_bytes(4, "big") + bytes(7))


def _bad_label(path: Path) -> None:
    with gzip.open(path, "wb") as f:
        f.write((0x0801).to_bytes(4, "big") + (40).to_bytes(4, "big") + bytes([42] * 40))


@pytest.mark.parametrize(
    "file, damage, words",
    [
        ("train-images-idx3-ubyte.gz", _truncate, "truncated or corrupt"),
        ("t10k-labels-idx1-ubyte.gz", _random_bytes, "truncated or corrupt"),
        ("train-labels-idx1-ubyte.gz", _wrong_magic, "not an IDX file"),
        ("train-labels-idx1-ubyte.gz", _short_labels, "images for (7,) labels"),
        ("train-labels-idx1-ubyte.gz", _bad_label, "label 42 outside the 10 classes"),
    ],
)
def test_a_damaged_dataset_archive_is_named(tmp_path, capsys, file, damage, words):
    raw = _fake_mnist(tmp_path / "data")
    damage(raw / file)
    config = write_config(tmp_path, data={"dataset": "mnist", "root": str(tmp_path / "data"), "num_clients": 4})
    code, err = cli(capsys, "partition", config, "--out", tmp_path / "part")
    assert code == 2 and err.count("\n") == 1, err
    assert "delete it to download it again" in err and words in err, err
    assert str(raw) in err  # the path names the damaged file (or its pair)
    assert not (tmp_path / "part").exists()


@pytest.mark.slow
def test_a_damaged_archive_stops_a_run_in_one_line(tmp_path):
    raw = _fake_mnist(tmp_path / "data")
    _truncate(raw / "t10k-images-idx3-ubyte.gz")
    config = write_config(tmp_path, data={"dataset": "mnist", "root": str(tmp_path / "data"), "num_clients": 4})
    code, _, err, seconds, tag = run_cli(["run", str(config), "--out", str(tmp_path / "run")])
    assert code == 2 and seconds < 60
    assert_one_line_error(err, f"{raw / 't10k-images-idx3-ubyte.gz'}: truncated or corrupt")
    assert tagged_processes(tag) == []


@pytest.mark.slow
def test_offline_the_quick_start_says_what_works_at_once(tmp_path, capsys, monkeypatch):
    import torchvision

    def offline(*args, **kwargs):
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz:\n<urlopen error [Errno -3] no network>")

    monkeypatch.setattr(torchvision.datasets, "MNIST", offline)
    root = tmp_path / "nothing" / "here"
    config = write_config(tmp_path, data={"dataset": "mnist", "root": str(root), "num_clients": 4, "limit": 100})
    code, err = cli(capsys, "run", config, "--out", tmp_path / "run")
    assert code == 2 and err.count("\n") == 1, err
    assert "the download failed (urlopen error [Errno -3] no network)" in err
    assert err.strip().endswith(f"fedsim run {config} --set data.dataset=synthetic --set data.limit=null")
    assert not (tmp_path / "nothing").exists()  # the folders made for the download are gone again
    code, _ = cli(
        capsys, "run", config, "--out", tmp_path / "run", "--set", "data.dataset=synthetic", "--set", "data.limit=null"
    )
    assert code == 0  # and the suggested command works


# ----------------------------------------------------------------------------- run directories


@pytest.mark.parametrize(
    "file, text",
    [
        ("metrics.csv", "this is,not\nmetrics\n"),
        ("metrics.csv", "\x89PNG\r\n\x1a\n\x00\x00binary"),
        ("metrics.csv", "round,test_accuracy\n1,0.5\n2\n"),
        ("summary.json", "[1, 2, 3]"),
        ("summary.json", "{broken"),
        ("config.yaml", "a: [unclosed"),
        ("metrics.csv", "round,test_accuracy,test_loss\n1,high,0.5\n"),
    ],
)
def test_a_damaged_run_file_given_to_plot_is_one_line(tmp_path, capsys, finished, file, text):
    (copy_of(finished, tmp_path) / file).write_text(text)
    code, err = cli(capsys, "plot", tmp_path / "run", "-o", tmp_path / "fig.png")
    assert code == 2 and err.count("\n") == 1 and str(tmp_path / "run" / file) in err, err
    assert not (tmp_path / "fig.png").exists()


@pytest.mark.slow
def test_resume_without_metrics_or_with_another_models_checkpoint_is_refused(tmp_path, capsys, finished):
    copy_of(finished, tmp_path)
    fedsim.run(BASE, out=tmp_path / "other", quiet=True, rounds=1, model="mnist_2nn")
    fedsim.run(BASE, out=tmp_path / "adam", quiet=True, rounds=1, server_optimizer="fedadam")
    run = tmp_path / "run"
    metrics = (run / "metrics.csv").read_text()

    shutil.copy(tmp_path / "other" / "checkpoint.pt", run / "checkpoint.pt")
    code, err = cli(capsys, "run", "--resume", run, "--set", "rounds=3")
    assert code == 2 and err.count("\n") == 1, err
    assert f"{run}: config.yaml says model: 'mnist_cnn' but checkpoint.pt was written by a run with 'mnist_2nn'" in err
    # a checkpoint without the record of its run and its files (an older version's) is still
    # checked tensor by tensor
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    del state["config"], state["file_last_rows"]
    torch.save(state, run / "checkpoint.pt")
    code, err = cli(capsys, "run", "--resume", run, "--set", "rounds=3")
    assert code == 2 and err.count("\n") == 1, err
    assert f"{run / 'checkpoint.pt'}: holds shape (199210,) for global" in err and "it is not this run's" in err
    assert (run / "metrics.csv").read_text() == metrics  # nothing was changed

    state = torch.load(tmp_path / "adam" / "checkpoint.pt", weights_only=True)
    del state["config"], state["server_optimizer"]["first_moment"]
    torch.save(state, tmp_path / "adam" / "checkpoint.pt")
    code, err = cli(capsys, "run", "--resume", tmp_path / "adam", "--set", "rounds=3")
    assert code == 2 and "holds nothing for server_optimizer.first_moment" in err, err

    (run / "metrics.csv").unlink()
    code, err = cli(capsys, "run", "--resume", run, "--set", "rounds=3")
    assert code == 2 and err.count("\n") == 1 and f"{run / 'metrics.csv'}: missing" in err, err


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda state: state.update(round="1"), "its round is '1'"),
        (lambda state: state["server_optimizer"].update(velocity=torch.zeros(3)), "holds server_optimizer.velocity"),
        (lambda state: state.update(torch_rng=torch.zeros(3)), "holds shape (3,) for torch_rng"),
    ],
)
def test_resume_refuses_a_checkpoint_torn_by_hand(tmp_path, capsys, finished, change, words):
    copy_of(finished, tmp_path)
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    change(state)
    torch.save(state, tmp_path / "run" / "checkpoint.pt")
    code, err = cli(capsys, "run", "--resume", tmp_path / "run", "--set", "rounds=2")
    assert code == 2 and err.count("\n") == 1 and words in err, err


def _cut_to_header(path: Path) -> None:
    path.write_text(path.read_text().splitlines(keepends=True)[0])


def _nan_in_the_weights(run: Path) -> None:
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    state["global"][0] = float("nan")
    torch.save(state, run / "checkpoint.pt")


@pytest.mark.parametrize(
    "damage, words",
    [
        (
            lambda run: _cut_to_header(run / "metrics.csv"),
            "metrics.csv: holds 0 rows up to round 1, but checkpoint.pt was saved when it held 1; the run directory's "
            "files disagree",
        ),
        (
            lambda run: (run / "metrics.csv").write_text(
                (run / "metrics.csv").read_text() + (run / "metrics.csv").read_text().splitlines(keepends=True)[1]
            ),
            "metrics.csv: holds 2 rows up to round 1, but checkpoint.pt was saved when it held 1",
        ),
        (
            lambda run: (run / "clients.csv").unlink(),
            "clients.csv: holds 0 rows up to round 1, but checkpoint.pt was saved when it held 2",
        ),
        (
            lambda run: (run / "clients.csv").write_text((run / "clients.csv").read_text() + "1,3,,16,2.0,0.5,0,0,1\n"),
            "clients.csv: holds 3 rows up to round 1",
        ),
        (_nan_in_the_weights, "checkpoint.pt: global holds NaN or Inf; the checkpoint is damaged"),
    ],
    ids=["metrics cut to its header", "a metrics row twice", "clients gone", "a client row added", "NaN weights"],
)
def test_resume_refuses_a_directory_whose_files_disagree(tmp_path, capsys, finished, damage, words):
    run = copy_of(finished, tmp_path)
    damage(run)
    files = {path.name: path.read_bytes() for path in run.iterdir()}
    code, err = cli(capsys, "run", "--resume", run, "--set", "rounds=2")
    assert code == 2 and err.count("\n") == 1 and words in err, err
    assert {path.name: path.read_bytes() for path in run.iterdir()} == files  # nothing was changed


def test_resume_says_that_a_key_asked_for_cannot_change(tmp_path, capsys, finished):
    run = copy_of(finished, tmp_path)
    code, err = cli(capsys, "run", "--resume", run, "--set", "model=mnist_2nn")
    assert code == 2 and err.count("\n") == 1, err
    assert f"--set model='mnist_2nn': cannot change when resuming; {run} ran with model: 'mnist_cnn'" in err


def test_resume_accepts_a_key_asked_for_at_the_value_the_run_has(tmp_path, capsys, finished):
    """Repeating the run's own values (a command line copied from the first run) changes nothing."""
    run = copy_of(finished, tmp_path)
    same = ["local.lr=0.05", "attack.fraction=0", "data.num_clients=4", "local={lr: 0.05}", "seed=2"]
    code, err = cli(capsys, "run", "--resume", run, "--set", "rounds=2", *[a for s in same for a in ("--set", s)])
    assert code == 0, err
    assert fedsim.load_run(run).round == [1, 2]
    code, err = cli(capsys, "run", "--resume", run, "--set", "rounds=3", "--set", "local={lr: 0.05, momentum: 0.5}")
    assert code == 2 and "--set local.momentum: cannot change when resuming" in err, err


def test_resume_takes_no_out_and_no_overwrite(tmp_path, capsys):
    for extra in (["--out", tmp_path / "elsewhere"], ["--overwrite"]):
        code, err = cli(capsys, "run", "--resume", tmp_path / "run", *extra)
        assert code == 2 and err.count("\n") == 1 and "does not apply to --resume" in err, err


def test_a_sweep_refuses_two_spellings_of_one_value(tmp_path, capsys):
    code, err = cli(capsys, "sweep", write_config(tmp_path), "--grid", "local.lr=0.1,0.10", "--out", tmp_path / "s")
    assert code == 2 and "local.lr=0.1 and local.lr=0.10 are the same experiment" in err, err
    assert not (tmp_path / "s").exists()


def test_an_error_found_after_loading_names_where_the_value_came_from(tmp_path, capsys):
    whole = write_config(tmp_path, data={"dataset": "synthetic", "num_clients": 4})  # 6,000 samples
    code, err = cli(capsys, "partition", whole, "--set", "data.num_clients=7000", "--out", tmp_path / "part")
    assert code == 2 and err.strip() == "fedsim: error: --set data.num_clients: 7000 clients but only 6000 samples"


@pytest.mark.parametrize("width", ["nan", "inf", "1e6", "0"])
def test_plot_refuses_a_width_it_cannot_draw(tmp_path, capsys, finished, width):
    code, err = cli(capsys, "plot", finished, "-o", tmp_path / "fig.png", "--width", width)
    assert code == 2 and err.count("\n") == 1 and "a width from 0.5 to 50 inches" in err, err


@pytest.mark.slow
def test_an_output_that_cannot_be_written_is_one_line(tmp_path):
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "fedsim", "list"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=60
        )
    assert (
        done.returncode == 1
        and done.stderr.strip() == "fedsim: error: cannot write the output: No space left on device"
    )


def test_resume_refuses_a_config_edited_by_hand(tmp_path, capsys, finished):
    copy_of(finished, tmp_path)
    config = tmp_path / "run" / "config.yaml"
    config.write_text(config.read_text().replace("lr: 0.05", "lr: 0.5"))
    code, err = cli(capsys, "run", "--resume", tmp_path / "run", "--set", "rounds=2")
    assert code == 2 and err.count("\n") == 1, err
    assert f"{tmp_path / 'run'}: config.yaml says local.lr: 0.5 but checkpoint.pt was written by a run with 0.05" in err


# ----------------------------------------------------------------------------- diagnosis


@pytest.mark.parametrize(
    "text, cause",
    [
        ("RuntimeError: unable to write to file </torch_123_456_0>: No space left on device (28)", "shared memory"),
        ("OSError: [Errno 28] No space left on device: 'runs/x/checkpoint.pt'", "a disk is full"),
        (
            "RuntimeError: unable to open shared memory object </torch_1_2_3> in read-write mode: "
            "Too many open files (24)",
            "too many open file descriptors",
        ),
        ("OSError: [Errno 24] Too many open files", "too many open file descriptors"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "the GPU is out of memory"),
        ("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 10 bytes", "host memory"),
    ],
)
def test_each_exhaustion_is_told_apart_by_its_own_words(text, cause):
    assert resource_hint(text).startswith(cause)


@pytest.mark.slow
def test_a_low_descriptor_limit_is_named_before_anything_starts(tmp_path):
    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))

    config = write_config(tmp_path, workers=2, clients_per_round=2)
    code, _, err, seconds, tag = run_cli(
        ["run", str(config), "--out", str(tmp_path / "run")], popen_options={"preexec_fn": low_limit}
    )
    assert code == 1 and seconds < 60, err
    assert_one_line_error(err, "too few file descriptors", "(ulimit -n) is 40", "sharing_strategy: file_system")
    assert "shared memory" not in err
    assert tagged_processes(tag) == []


# ----------------------------------------------------------------------------- the edges of a run


@pytest.mark.slow
def test_the_global_model_never_becomes_non_finite(tmp_path):
    # a scaling attacker's finite update makes Yogi's squared pseudo-gradient overflow
    config = write_config(
        tmp_path,
        rounds=4,
        clients_per_round=4,
        server_optimizer="fedyogi",
        aggregator="mean",
        attack={"type": "scale", "fraction": 0.25, "scale": 1e30},
    )
    code, _, err, _, tag = run_cli(["run", str(config), "--out", str(tmp_path / "run")])
    assert code == 1, err
    assert_one_line_error(
        err,
        "the server optimizer fedyogi made the global weights non-finite",
        "although every client update used was finite",
        "the checkpoint of round 1 is kept",
    )
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert state["round"] == 1 and torch.isfinite(state["global"]).all()
    assert [row["round"] for row in fedsim.load_run(tmp_path / "run").rows] == [1]
    assert tagged_processes(tag) == []


@pytest.mark.slow
def test_an_interrupt_at_the_very_end_tells_the_truth(tmp_path):
    config = write_config(tmp_path, rounds=2)
    run_dir = tmp_path / "run"
    proc = start(["run", str(config), "--out", str(run_dir)], uuid.uuid4().hex)
    wait_for_round(proc, 2)  # the last round's line: the summary and the plot are being written now
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 2
    assert (run_dir / "accuracy.png").is_file() and leftovers(run_dir) == []
    if proc.returncode == 130:  # the signal came before the command ended
        assert err.strip() == f"fedsim: interrupted after the run finished; its results are in {run_dir}"
    else:
        assert proc.returncode == 0 and err == ""


def test_an_interrupt_held_through_the_last_rounds_files_finds_the_run_finished(tmp_path):
    # the signal lands while the last round is being written (deterministically: from a callback
    # inside that step) and is delivered as the step ends
    class InterruptAtTheEnd(fedsim.Callback):
        def on_round_end(self, row, clients):
            if row["round"] == 2:
                os.kill(os.getpid(), signal.SIGINT)

    tiny = {
        "name": "tiny",
        "seed": 1,
        "device": "cpu",
        "rounds": 2,
        "workers": 0,
        "clients_per_round": 2,
        "data": {"dataset": "synthetic", "num_clients": 2, "limit": 200},
    }
    with pytest.raises(KeyboardInterrupt):
        fedsim.run(tiny, out=tmp_path / "run", quiet=True, callbacks=[InterruptAtTheEnd()])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["rounds"] == 2


def test_an_interrupt_just_after_the_last_round_finds_the_run_finished(tmp_path, monkeypatch):
    # the signal lands after the last round's files, before the end's files begin to hold signals:
    # the end's files are still written, and the interrupt still stops the caller
    from fedsim.execution import interrupts  # imported first, session keeps the real one for the rounds
    from fedsim.runs import session

    hold, sent = interrupts.shielded, []
    assert session.shielded is hold

    def too_late():
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # raised at the next call, before any handler is changed
        return hold()

    monkeypatch.setattr(interrupts, "shielded", too_late)
    tiny = {
        "name": "tiny",
        "seed": 1,
        "device": "cpu",
        "rounds": 2,
        "workers": 0,
        "clients_per_round": 2,
        "data": {"dataset": "synthetic", "num_clients": 2, "limit": 200},
    }
    with pytest.raises(KeyboardInterrupt):
        fedsim.run(tiny, out=tmp_path / "run", quiet=True)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert sent and summary["status"] == "finished" and summary["rounds"] == 2
    assert (tmp_path / "run" / "accuracy.png").is_file() and leftovers(tmp_path / "run") == []


@pytest.mark.slow
def test_a_run_directory_in_use_is_refused(tmp_path, finished):
    copy_of(finished, tmp_path)
    first = start(["run", "--resume", str(tmp_path / "run"), "--set", "rounds=2000"], uuid.uuid4().hex)
    wait_for_round(first, 2)
    for args in (
        ["run", "--resume", str(tmp_path / "run"), "--set", "rounds=3000"],
        ["run", str(write_config(tmp_path)), "--out", str(tmp_path / "run"), "--overwrite"],
    ):
        code, _, err, _, _ = run_cli(args)
        assert code == 1
        assert_one_line_error(err, f"{tmp_path / 'run'}: another fedsim process is running in this directory")
    first.send_signal(signal.SIGINT)
    first.communicate(timeout=30)
    rounds = [row["round"] for row in fedsim.load_run(tmp_path / "run").rows]
    assert rounds == list(range(1, len(rounds) + 1))  # one run's rows, in order


def test_a_directory_in_use_is_refused_before_torch_is_imported(tmp_path):
    """The refusal needs only the directory's lock: it comes at once, before torch is imported
    (seconds), for a resume and for a new run into the same --out."""
    held = RunDirectory(tmp_path / "run")
    (tmp_path / "run").mkdir()
    held.lock()  # a lock of this process's own: the command in another process is refused
    script = textwrap.dedent("""
        import sys
        from fedsim.cli import main
        try:
            main(sys.argv[1:])
        except SystemExit as e:
            print(e.code, "torch" in sys.modules)
    """)
    try:
        for args in (
            ["run", "--resume", str(tmp_path / "run")],
            ["run", str(write_config(tmp_path)), "--out", str(tmp_path / "run"), "--overwrite"],
        ):
            done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60)
            assert done.stdout.split() == ["1", "False"], done.stdout + done.stderr
            assert_one_line_error(
                done.stderr, f"{tmp_path / 'run'}: another fedsim process is running in this directory"
            )
    finally:
        held.unlock()


@pytest.mark.slow
def test_ctrl_c_while_the_workers_import_torch_is_one_line(tmp_path):
    config = write_config(tmp_path, workers=2)
    proc = start(
        ["run", str(config), "--out", str(tmp_path / "run")],
        uuid.uuid4().hex,
        popen_options={"start_new_session": True},
    )
    deadline = time.monotonic() + 60
    while not fork_server_of(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the fork server is importing torch for the workers now, and so is the command
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to every process of the group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("fedsim: interrupted"), err


@pytest.mark.slow
def test_a_ctrl_c_caught_in_code_made_from_source_text_still_exits_130(tmp_path):
    # a Ctrl-C landing while a dataclass or namedtuple makes its methods (exec of source text):
    # CPython remembers it even once handled, and under `python -m` would end the process by SIGINT
    (tmp_path / "interrupting.py").write_text('exec("raise KeyboardInterrupt", {})\n')
    config = write_config(tmp_path, model="interrupting:Net", workers=0)
    code, _, err, _, _ = run_cli(
        ["run", str(config), "--out", str(tmp_path / "run")], PYTHONPATH=f"{tmp_path}{os.pathsep}{TESTS_DIR}"
    )
    assert code == 130 and err == "fedsim: interrupted\n", (code, err)


@pytest.mark.slow
def test_a_reader_that_goes_away_does_not_stop_the_run(tmp_path):
    config = write_config(tmp_path, rounds=3)
    proc = start(["run", str(config), "--out", str(tmp_path / "run"), "--no-progress"], uuid.uuid4().hex)
    proc.stdout.readline()
    proc.stdout.close()  # `fedsim run ... | head -1`
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "finished"

    listing = subprocess.Popen([sys.executable, "-m", "fedsim", "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    listing.stdout.readline()
    listing.stdout.close()
    assert listing.wait(timeout=60) == 0 and b"Traceback" not in listing.stderr.read()


def test_a_dataset_pickle_cannot_run_code(tmp_path, capsys):
    from support import write_fake_cifar

    write_fake_cifar(tmp_path / "data")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (tmp_path / "data" / "cifar-10-batches-py" / "batches.meta").write_bytes(__import__("pickle").dumps(Payload()))
    config = write_config(tmp_path, data={"dataset": "cifar10", "root": str(tmp_path / "data"), "num_clients": 4})
    code, err = cli(capsys, "partition", config, "--out", tmp_path / "part")
    assert code == 2 and err.count("\n") == 1 and "batches.meta: cannot read this CIFAR-10 file" in err, err
    assert "asks to load posix.system" in err
    assert not marker.exists()
