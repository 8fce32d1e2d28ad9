"""The experiment trackers (MLflow, Weights & Biases) hold what the run wrote to its own files:
each is run with the real library, offline, and what it logged is read back."""

from __future__ import annotations

import csv
import json
import re
import shlex
import statistics
import struct
from pathlib import Path

import pytest
import yaml
from support import child_pids

import fedsim
from fedsim.cli import main
from fedsim.core.errors import ConfigError, FedsimError
from fedsim.experiment.config import TRACKERS as TRACKER_NAMES
from fedsim.runs.callbacks import TRACKERS, MLflow, TensorBoard, WandB, _needs, trackers_of

REPO = Path(__file__).resolve().parent.parent
TINY = {
    "name": "tracked",
    "seed": 3,
    "device": "cpu",
    "rounds": 2,
    "workers": 0,
    "clients_per_round": 3,
    "data": {"dataset": "synthetic", "num_clients": 4, "limit": 900},
    "local": {"lr": 0.05, "batch_size": 32},
}


def test_every_tracker_a_config_may_name_has_its_callback():
    assert tuple(TRACKERS) == TRACKER_NAMES == ("tensorboard", "mlflow", "wandb")
    assert fedsim.callbacks.MLflow is MLflow and fedsim.callbacks.WandB is WandB


def test_a_tracker_is_named_from_the_list():
    with pytest.raises(
        ConfigError,
        match=r"trackers: must be one of tensorboard, mlflow, wandb, got 'mlfow' \(did you mean 'mlflow'\?\)$",
    ):
        fedsim.load_config(TINY, {"trackers": ["mlfow"]})
    with pytest.raises(ConfigError, match=r"trackers: names a tracker twice"):
        fedsim.load_config(TINY, {"trackers": ["wandb", "wandb"]})


def test_a_tracker_given_as_an_object_is_not_added_again():
    cfg = fedsim.load_config(TINY, {"trackers": ["tensorboard", "mlflow"]})
    own = TensorBoard(log_dir="elsewhere")
    assert [type(c) for c in trackers_of(cfg, [own])] == [MLflow]
    assert [type(c) for c in trackers_of(cfg)] == [TensorBoard, MLflow]


def test_the_trackers_keys_change_no_run(tmp_path):
    from fedsim.experiment.config import directory_name

    assert directory_name(fedsim.load_config(TINY, {"trackers": ["wandb"]})) == "tracked"


def test_a_missing_package_is_one_line(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "mlflow", None)  # as if it were not installed
    with pytest.raises(FedsimError) as info:
        _needs("mlflow", "MLflow", "mlflow")
    assert str(info.value) == 'the MLflow tracker needs the mlflow package: pip install "fedsim-sync[mlflow]"'


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def trained_figures(run_dir: Path, key: str) -> dict[int, list[float]]:
    """Each round's figures ``key`` of the clients that trained, from clients.csv."""
    figures: dict[int, list[float]] = {}
    for row in read_csv(run_dir / "clients.csv"):
        if row["dropped"] == "0":
            figures.setdefault(int(row["round"]), []).append(float(row[key]))
    return figures


# ------------------------------------------------------------------------------------ TensorBoard


@pytest.mark.slow
def test_tensorboard_holds_what_the_run_wrote(tmp_path):
    pytest.importorskip("tensorboard")
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    history = fedsim.run(TINY, out=tmp_path / "run", quiet=True, trackers=["tensorboard"])
    everything = {"scalars": 0, "histograms": 0, "tensors": 0, "images": 0}  # 0: keep every event
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance=everything).Reload()
    logged = [(e.step, e.value) for e in events.Scalars("test_accuracy")]
    assert logged == [(r, float(np.float32(a))) for r, a in zip(history.round, history.test_accuracy)]  # float32
    assert {"clients/train_loss", "clients/update_norm"} <= set(events.Tags()["histograms"])
    counts = {e.step: e.histogram_value.num for e in events.Histograms("clients/train_loss")}
    assert counts == {r: len(v) for r, v in trained_figures(history.run_dir, "train_loss").items()}
    texts = {tag: events.Tensors(tag)[-1].tensor_proto.string_val[0].decode() for tag in events.Tags()["tensors"]}
    assert yaml.safe_load(dedent_lines(texts["config/text_summary"])) == history.config
    assert json.loads(dedent_lines(texts["summary/text_summary"])) == history.summary
    (image,) = events.Images("plot")
    assert (image.step, image.width > 0, image.height > 0) == (2, True, True)


def dedent_lines(text: str) -> str:
    return "\n".join(line.removeprefix("    ") for line in text.splitlines())


# ---------------------------------------------------------------------------------------- MLflow


@pytest.mark.slow
def test_mlflow_holds_what_the_run_wrote_and_a_resume_goes_on_in_it(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # MLflow's own default store: mlflow.db in the working directory
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump({**TINY, "trackers": ["mlflow"], "eval_every": 2}))
    with pytest.raises(SystemExit) as info:
        main(["run", "exp.yaml", "--out", "run", "--quiet"])
    assert info.value.code == 0
    with pytest.raises(SystemExit) as info:
        main(["run", "--resume", "run", "--set", "rounds=3", "--quiet"])  # config.yaml keeps the tracker
    assert info.value.code == 0
    run_dir = tmp_path / "run"

    client = MlflowClient(tracking_uri=mlflow.get_tracking_uri())
    assert client.tracking_uri.startswith("sqlite:") and (tmp_path / "mlflow.db").is_file()
    (run,) = client.search_runs([client.get_experiment_by_name("tracked").experiment_id])
    assert (run.info.status, run.info.run_name, run.data.tags["fedsim.status"]) == ("FINISHED", "run", "finished")
    assert run.data.tags["fedsim.run_dir"] == str(run_dir.resolve())

    def history(key):
        return [
            (m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        ]

    rows = read_csv(run_dir / "metrics.csv")
    assert [r["round"] for r in rows] == ["2", "3"]  # round 1 was not evaluated: no accuracy of it is logged
    assert history("test_accuracy") == [(int(r["round"]), float(r["test_accuracy"])) for r in rows]
    assert [step for step, _ in history("train_loss")] == [1, 2, 3]  # every round, the resumed one too
    for key in ("train_loss", "update_norm"):  # 3 clients a round: the median is one of them, exactly
        figures = sorted(trained_figures(run_dir, key).items())
        assert history(f"clients/{key}/median") == [(r, statistics.median(v)) for r, v in figures]
        assert history(f"clients/{key}/max") == [(r, max(v)) for r, v in figures]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert run.data.metrics["final_test_accuracy"] == summary["final_test_accuracy"]
    assert run.data.params["local.lr"] == "0.05" and run.data.params["data.dataset"] == "synthetic"
    assert run.data.params["trackers"] == '["mlflow"]'

    artifacts = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "artifacts")))
    assert json.loads((artifacts / "summary.json").read_text()) == summary
    assert (
        yaml.safe_load((artifacts / "config.yaml").read_text())["local"]
        == yaml.safe_load((run_dir / "config.yaml").read_text())["local"]
    )
    for name in ("accuracy.png", "clients.csv"):
        assert (artifacts / name).read_bytes() == (run_dir / name).read_bytes()


# -------------------------------------------------------------------------------- Weights & Biases


def wandb_records(run_dir: Path) -> list:
    """The records of the offline runs under ``run_dir/wandb``, oldest run first: the
    ``.wandb`` files are LevelDB-style logs (32 KiB blocks of chunks with a 7-byte header: CRC,
    length, kind) of protobuf ``Record`` messages, after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    records = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, block, pending = path.read_bytes(), 7, 32768, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # the end of a block too short for a header is padding
                pos += block - pos % block
                continue
            length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
            pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
            if kind in (1, 4):  # a whole record, or the last chunk of one
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                records.append(record)
                pending = b""
    return records


def items(update) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in update}


@pytest.mark.slow
def test_wandb_offline_holds_what_the_run_wrote(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    history = fedsim.run(TINY, out=tmp_path / "run", quiet=True, trackers=["wandb"])
    fedsim.resume(tmp_path / "run", quiet=True, rounds=3)
    resumed = fedsim.load_run(tmp_path / "run")
    run_dir = history.run_dir

    records = wandb_records(run_dir)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert len(runs) == 2 and runs[0].run_id == runs[1].run_id  # the resume goes on in the same run
    assert (runs[0].project, runs[0].display_name) == ("tracked", "run")
    config = {k: v for k, v in items(runs[0].config.update).items() if k != "_wandb"}
    assert config == history.config

    logged = [items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    rounds = [h for h in logged if "test_accuracy" in h]
    assert [(h["round"], h["test_accuracy"]) for h in rounds] == list(zip(resumed.round, resumed.test_accuracy))
    figures = trained_figures(run_dir, "train_loss")
    for h in rounds:  # a histogram of every trained client's loss
        assert sum(h["clients/train_loss/values"]) == len(figures[h["round"]])
        assert h["clients/train_loss/bins"][0] == min(figures[h["round"]])

    tables = [h for h in logged if "clients/_type" in h][-1]  # the resumed run's, at its end
    table_path = sorted(run_dir.glob(f"wandb/offline-run-*/files/{tables['clients/path']}"))[-1]
    table = json.loads(table_path.read_text())
    assert len(table["data"]) == len(read_csv(run_dir / "clients.csv"))
    assert tables["plot/_type"] == "image-file"

    summaries = [items(r.summary.update) for r in records if r.WhichOneof("record_type") == "summary"]
    final = {k: v for s in summaries for k, v in s.items()}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert final["final_test_accuracy"] == summary["final_test_accuracy"] == resumed.test_accuracy[-1]
    assert final["status"] == "finished" and final["rounds"] == 3
    assert child_pids() == []  # W&B's service process ends with the run


# ------------------------------------------------------------------------------------ the docs


@pytest.mark.slow
def test_the_trackers_commands_of_the_docs_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    page = (REPO / "docs" / "results.md").read_text()
    section = page[page.index("## Trackers") :]
    (block,) = re.findall(r"^```bash\n(.*?)^```", section[: section.index("\n## ")], re.M | re.S)
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    runs = [words for words in commands if words[:2] == ["fedsim", "run"]]
    assert runs and all(words[0] in ("pip", "fedsim") for words in commands if words)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    for words in runs:
        with pytest.raises(SystemExit) as info:
            main([*words[1:], "--set", "data.limit=600", "--set", "device=cpu", "--set", "workers=0", "--quiet"])
        assert info.value.code == 0
    assert (tmp_path / "mlflow.db").is_file()
    assert list(tmp_path.glob("runs/*/wandb/offline-run-*/run-*.wandb"))
