"""hf: datasets, read by the Hugging Face ``datasets`` library from small files written here in
the published format: parquet with the schema of flwrlabs/femnist (its dataset card: image as an
Image feature, writer_id a string, hsf_id an int64, character a ClassLabel of 62 names; one train
split), an Image stored as the {"bytes", "path"} struct of PNG bytes, and the features in the
file's "huggingface" metadata, as ``datasets`` writes them."""

from __future__ import annotations

import io
import json
import string
import sys
import time

import numpy as np
import pytest
import torch
import yaml
from support import Later, installed

pytestmark = pytest.mark.skipif(not installed("datasets", "pyarrow", "PIL"), reason="needs datasets, pyarrow, Pillow")
datasets, pa, pq, Image = Later("datasets"), Later("pyarrow"), Later("pyarrow.parquet"), Later("PIL.Image")

import fedsim  # noqa: E402
from fedsim.cli import main  # noqa: E402
from fedsim.core.errors import ConfigError, DataError  # noqa: E402
from fedsim.data import check_dataset_spec, load_dataset  # noqa: E402
from fedsim.data.hub import check_hub_options, load_hub  # noqa: E402
from fedsim.experiment.federation import load_federation  # noqa: E402
from fedsim.experiment.validation import load_config  # noqa: E402

CHARACTERS = [*string.digits, *string.ascii_uppercase, *string.ascii_lowercase]  # the card's 62 names, in order
FEMNIST_FEATURES = {
    "image": {"_type": "Image"},
    "writer_id": {"dtype": "string", "_type": "Value"},
    "hsf_id": {"dtype": "int64", "_type": "Value"},
    "character": {"names": CHARACTERS, "_type": "ClassLabel"},
}
FEMNIST = {"input": "image", "label": "character", "client": "writer_id"}


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """The library's cache in tmp_path, not the home folder (it is read at each load)."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path / "hf-cache"


def png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def femnist_rows(writers: dict[str, int], seed: int = 0, first: int = 0) -> dict:
    """Samples of the given writers: random 28x28 grey images whose pixels (0, 0) and (0, 1) are 0
    and 255 and (0, 2) is the sample's number, so that a sample is known again from its pixels
    whatever affine normalization they went through."""
    rng = np.random.default_rng(seed)
    n = sum(writers.values())
    pixels = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    pixels[:, 0, 0], pixels[:, 0, 1], pixels[:, 0, 2] = 0, 255, np.arange(first, first + n)
    return {
        "pixels": pixels,
        "writer_id": [w for w, count in writers.items() for _ in range(count)],
        "hsf_id": rng.integers(0, 8, n).tolist(),
        "character": rng.integers(0, 62, n).tolist(),
    }


def write_femnist(path, rows: dict, features: dict = FEMNIST_FEATURES) -> None:
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table(
        {
            "image": pa.array([{"bytes": png(p), "path": None} for p in rows["pixels"]], type=image),
            "writer_id": pa.array(rows["writer_id"], pa.string()),
            "hsf_id": pa.array(rows["hsf_id"], pa.int64()),
            "character": pa.array(rows["character"], pa.int64()),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})}), path)


def sample_numbers(x: torch.Tensor) -> np.ndarray:
    """Pixel (0, 2) of each image back in 0..255, from the images' known 0 and 255 pixels."""
    low, high, mark = x[:, 0, 0, 0].double(), x[:, 0, 0, 1].double(), x[:, 0, 0, 2].double()
    return np.rint(((mark - low) / (high - low) * 255).numpy()).astype(int)


def normalized(raw: np.ndarray, train_raw: np.ndarray) -> np.ndarray:
    return (raw - train_raw.mean()) / train_raw.std()  # one channel: the mean and std of all its pixels


# ----------------------------------------------------------------------------- images, labels, clients


def test_femnist_schema_with_train_and_test_files_gives_its_pixels_labels_and_writers(tmp_path):
    train = femnist_rows({"f0000_14": 5, "f0001_41": 3, "f0002_07": 4}, seed=1)
    test = femnist_rows({"f0001_41": 2, "f0003_02": 2}, seed=2, first=100)
    write_femnist(tmp_path / "femnist" / "data" / "train-00000-of-00001.parquet", train)
    write_femnist(tmp_path / "femnist" / "data" / "test-00000-of-00001.parquet", test)
    data = load_dataset(f"hf:{tmp_path / 'femnist'}", tmp_path, hf=FEMNIST)

    assert data.num_classes == 62 and data.train_x.shape == (12, 1, 28, 28) and data.test_x.shape == (4, 1, 28, 28)
    assert data.train_x.dtype == torch.float32 and data.train_y.dtype == torch.int64
    raw_train, raw_test = train["pixels"].astype(np.float64), test["pixels"].astype(np.float64)
    np.testing.assert_allclose(data.train_x[:, 0].numpy(), normalized(raw_train, raw_train), atol=1e-5)
    np.testing.assert_allclose(data.test_x[:, 0].numpy(), normalized(raw_test, raw_train), atol=1e-5)
    assert data.train_y.tolist() == train["character"] and data.test_y.tolist() == test["character"]
    assert data.client_names == ("f0000_14", "f0001_41", "f0002_07", "f0003_02")
    assert [data.client_names[i] for i in data.train_clients] == train["writer_id"]
    assert [data.client_names[i] for i in data.test_clients] == test["writer_id"]
    held = load_dataset(f"hf:{tmp_path / 'femnist'}", tmp_path, hf={**FEMNIST, "test": None})  # out of train
    assert len(held.test_y) == 1 and len(held.train_y) == 11  # round(0.1 n) of 5, 3 and 4 samples


def test_a_single_train_split_holds_out_each_writers_fraction_the_same_way_every_time(tmp_path):
    sizes = {"f0000_14": 10, "f0001_41": 20, "f0002_07": 30}
    rows = femnist_rows(sizes, seed=3)
    write_femnist(tmp_path / "femnist.parquet", rows)
    spec, options = f"hf:{tmp_path / 'femnist.parquet'}", {**FEMNIST, "test_fraction": 0.2}
    data = load_hub(spec, options, tmp_path)

    train_ids, test_ids = sample_numbers(data.train_x), sample_numbers(data.test_x)
    assert sorted([*train_ids, *test_ids]) == list(range(60)) and list(train_ids) == sorted(train_ids)
    for ids, y, clients in ((train_ids, data.train_y, data.train_clients), (test_ids, data.test_y, data.test_clients)):
        assert y.tolist() == [rows["character"][i] for i in ids]
        assert [data.client_names[c] for c in clients] == [rows["writer_id"][i] for i in ids]
    for client, (writer, n) in enumerate(sizes.items()):
        assert data.client_names[client] == writer
        assert (data.test_clients == client).sum() == round(0.2 * n) and (
            data.train_clients == client
        ).sum() == n - n // 5
    raw = rows["pixels"].astype(np.float64)
    np.testing.assert_allclose(data.train_x[:, 0].numpy(), normalized(raw[train_ids], raw[train_ids]), atol=1e-5)
    np.testing.assert_allclose(data.test_x[:, 0].numpy(), normalized(raw[test_ids], raw[train_ids]), atol=1e-5)

    again = load_hub(spec, options, tmp_path)
    assert torch.equal(again.train_x, data.train_x) and torch.equal(again.test_clients, data.test_clients)
    default = load_hub(spec, FEMNIST, tmp_path)  # test_fraction 0.1
    assert torch.bincount(default.test_clients).tolist() == [1, 2, 3]


def test_without_a_client_column_the_fraction_is_of_all_samples(tmp_path):
    write_femnist(tmp_path / "f.parquet", femnist_rows({"w": 40}))
    data = load_hub(
        f"hf:{tmp_path / 'f.parquet'}", {"input": "image", "label": "character", "test_fraction": 0.25}, tmp_path
    )
    assert len(data.test_y) == 10 and len(data.train_y) == 30 and data.train_clients is None
    assert sorted([*sample_numbers(data.train_x), *sample_numbers(data.test_x)]) == list(range(40))


def test_natural_partition_gives_each_run_client_one_writer(tmp_path):
    sizes = {"f0000_14": 6, "f0001_41": 9, "f0002_07": 12}
    rows = femnist_rows(sizes)
    write_femnist(tmp_path / "f.parquet", rows)
    cfg = load_config(
        {
            "clients_per_round": 3,
            "data": {
                "dataset": f"hf:{tmp_path / 'f.parquet'}",
                "hf": FEMNIST,
                "partition": "natural",
                "num_clients": 3,
            },
        }
    )
    federation = load_federation(cfg)
    data = federation.data
    for part, test_part, writer in zip(federation.parts, federation.test_parts(), sizes):
        assert {data.client_names[c] for c in data.train_clients[part]} == {writer}
        assert {data.client_names[c] for c in data.test_clients[test_part]} == {writer}
    assert sorted(len(p) for p in federation.parts) == [5, 8, 11]  # each keeps n - round(0.1 n)


# ----------------------------------------------------------------------------- numbers


def test_csv_number_columns_side_by_side_and_its_train_and_test_files(tmp_path):
    rng = np.random.default_rng(4)
    splits = {"train": rng.normal(size=(12, 3)), "test": rng.normal(size=(5, 3))}
    labels = {"train": rng.integers(0, 4, 12), "test": rng.integers(0, 4, 5)}
    (tmp_path / "table").mkdir()
    for split, values in splits.items():
        lines = [
            "f0,f1,f2,label",
            *(",".join([*(repr(float(v)) for v in row), str(y)]) for row, y in zip(values, labels[split])),
        ]
        (tmp_path / "table" / f"{split}.csv").write_text("\n".join(lines) + "\n")
    data = load_hub(f"hf:{tmp_path / 'table'}", {"input": ["f0", "f1", "f2"], "label": "label"}, tmp_path)
    assert torch.equal(data.train_x, torch.tensor(splits["train"], dtype=torch.float32))
    assert torch.equal(data.test_x, torch.tensor(splits["test"], dtype=torch.float32))
    assert data.train_y.tolist() == labels["train"].tolist() and data.test_y.tolist() == labels["test"].tolist()
    assert data.num_classes == int(max(labels["train"].max(), labels["test"].max())) + 1


def test_json_lines_of_arrays_hold_out_a_tenth(tmp_path):
    rng = np.random.default_rng(5)
    values, labels = rng.integers(-50, 50, size=(30, 2, 3)), rng.integers(0, 3, 30)
    lines = [json.dumps({"x": v.tolist(), "y": int(y)}) for v, y in zip(values, labels)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    data = load_hub(f"hf:{tmp_path / 'd.jsonl'}", {"input": "x", "label": "y"}, tmp_path)
    assert data.train_x.shape == (27, 2, 3) and data.test_x.shape == (3, 2, 3) and data.num_classes == 3
    written = {tuple(v.ravel()): (i, y) for i, (v, y) in enumerate(zip(values, labels))}
    found = [written[tuple(x.ravel().tolist())] for x in torch.cat([data.train_x, data.test_x]).int()]
    assert sorted(i for i, _ in found) == list(range(30))
    assert [y for _, y in found] == [*data.train_y.tolist(), *data.test_y.tolist()]


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (None, "data.hf: an hf: dataset needs data.hf"),
        ({**FEMNIST, "colour": 1}, "data.hf.colour: unknown key; choose among: input, label"),
        ({"label": "character"}, "data.hf.input: missing"),
        ({"input": 3, "label": "character"}, "data.hf.input: must be a column name"),
        ({"input": "image", "label": ["character"]}, "data.hf.label: must be a column name"),
        ({**FEMNIST, "client": 7}, "data.hf.client: must be a column name"),
        ({**FEMNIST, "test": ""}, "data.hf.test: must be a split name"),
        ({**FEMNIST, "test_fraction": 1.5}, "data.hf.test_fraction: must be a fraction in (0, 1)"),
        ({**FEMNIST, "test_fraction": True}, "data.hf.test_fraction: must be a fraction in (0, 1)"),
        ("image", "data.hf: expected a mapping"),
    ],
)
def test_data_hf_is_checked_before_loading(options, expected):
    with pytest.raises(ConfigError) as info:
        check_hub_options("hf:flwrlabs/femnist", options)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)


def test_the_spec_is_checked_before_loading(tmp_path):
    check_dataset_spec("hf:flwrlabs/femnist")  # accepted: an hf: spec is not an import path
    with pytest.raises(ConfigError, match=r"^data\.hf: applies to data\.dataset hf:"):
        check_hub_options("mnist", FEMNIST)
    with pytest.raises(ConfigError, match=r"^data\.dataset: hf: needs a hub name or a local path"):
        check_hub_options("hf:", FEMNIST)
    with pytest.raises(ConfigError, match=r"no such file or folder"):
        check_hub_options(f"hf:{tmp_path / 'missing.parquet'}", FEMNIST)
    (tmp_path / "d.txt").write_text("1\n")
    with pytest.raises(ConfigError, match=r"a file must be one of \.parquet, \.arrow, \.csv, \.json"):
        check_hub_options(f"hf:{tmp_path / 'd.txt'}", FEMNIST)


@pytest.fixture
def femnist_file(tmp_path):
    write_femnist(tmp_path / "f.parquet", femnist_rows({"f0000_14": 10, "f0001_41": 10}))
    return f"hf:{tmp_path / 'f.parquet'}"


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            {**FEMNIST, "label": "label"},
            "data.hf.label: no column 'label' in hf:{path}; its columns: image, writer_id, hsf_id, character",
        ),
        ({**FEMNIST, "label": "writer_id"}, "data.hf.label: column 'writer_id' holds string, not integer class labels"),
        (
            {**FEMNIST, "input": "writer_id"},
            "data.hf.input: column 'writer_id' holds text; for text data give data.hf.text instead of input and label",
        ),
        ({**FEMNIST, "input": ["hsf_id", "writer_id"]}, "data.hf.input: column 'writer_id' holds text"),
        ({**FEMNIST, "train": "training"}, "data.hf.train: hf:{path} has no split 'training'; its splits: train"),
        ({**FEMNIST, "test": "validation"}, "data.hf.test: hf:{path} has no split 'validation'; its splits: train"),
        ({**FEMNIST, "test_fraction": 0.01}, "data.hf.test_fraction: holds out none of the 20 samples"),
    ],
)
def test_columns_and_splits_the_data_lacks_are_refused_naming_the_key(femnist_file, options, expected):
    with pytest.raises(DataError) as info:
        load_hub(femnist_file, options, None)
    assert str(info.value).startswith(expected.format(path=femnist_file[3:])) and "\n" not in str(info.value)


def test_mixed_shapes_are_refused(tmp_path):
    rows = femnist_rows({"a": 3})
    rows["pixels"] = [*rows["pixels"][:2], np.zeros((32, 32), np.uint8)]
    write_femnist(tmp_path / "f.parquet", rows)
    with pytest.raises(
        DataError, match=r"^data\.hf\.input: column 'image' holds images of mixed sizes \(28x28 and 32x32"
    ):
        load_hub(f"hf:{tmp_path / 'f.parquet'}", FEMNIST, None)
    (tmp_path / "d.jsonl").write_text('{"x": [1, 2, 3], "y": 0}\n{"x": [4, 5], "y": 1}\n')
    with pytest.raises(DataError, match=r"^data\.hf\.input: column 'x' holds arrays of mixed shapes"):
        load_hub(f"hf:{tmp_path / 'd.jsonl'}", {"input": "x", "label": "y"}, None)


def test_without_the_datasets_package_one_line_says_how_to_install_it(femnist_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    with pytest.raises(DataError) as info:
        load_hub(femnist_file, FEMNIST, None)
    assert str(info.value) == f'data.dataset: {femnist_file} needs the datasets package: pip install "fedsim-sync[hf]"'


def test_a_hub_name_offline_fails_at_once_in_one_line(monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1, as read when imported
    started = time.monotonic()
    with pytest.raises(DataError) as info:
        load_hub("hf:flwrlabs/femnist", FEMNIST, None)
    message = str(info.value)
    assert time.monotonic() - started < 5 and "\n" not in message
    assert message.startswith("data.dataset: hf:flwrlabs/femnist: not in the Hugging Face cache and HF_HUB_OFFLINE")
    assert "download it first" in message and "give a local path" in message


def test_a_hub_out_of_reach_fails_at_once_not_after_the_librarys_retries(monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", "http://127.0.0.1:1")  # nothing listens: refused at once
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(proxy, raising=False)
    started = time.monotonic()
    with pytest.raises(DataError) as info:
        load_hub("hf:flwrlabs/femnist", FEMNIST, None)
    message = str(info.value)
    assert message.startswith(
        "data.dataset: hf:flwrlabs/femnist: not in the Hugging Face cache and the hub is out of reach (127.0.0.1: "
    )
    assert "download it first" in message and "\n" not in message
    assert time.monotonic() - started < 5
    assert datasets.config.HF_HUB_OFFLINE is False  # the offline mode was for that one load


def test_a_cached_hub_dataset_loads_while_the_hub_is_out_of_reach(tmp_path, hf_cache, monkeypatch):
    """A copy in the library's cache, made here as a load of a local folder named femnist and moved
    where a hub download of flwrlabs/femnist would have put it."""
    write_femnist(tmp_path / "femnist" / "data" / "train-00000-of-00001.parquet", femnist_rows({"a": 10, "b": 10}))
    datasets.load_dataset(str(tmp_path / "femnist"))
    built = sorted(hf_cache.glob("femnist/*/*/*/"))
    if len(built) != 1:
        pytest.skip(f"this datasets version lays its cache out differently ({len(built)} folders)")
    (hf_cache / "flwrlabs___femnist").mkdir()
    (hf_cache / "femnist").rename(hf_cache / "flwrlabs___femnist" / "femnist")
    for nested in (hf_cache / "flwrlabs___femnist" / "femnist").iterdir():
        nested.rename(hf_cache / "flwrlabs___femnist" / nested.name)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", "http://127.0.0.1:1")
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    data = load_hub("hf:flwrlabs/femnist", FEMNIST, None)
    assert data.client_names == ("a", "b") and len(data.train_y) == 18 and len(data.test_y) == 2


# ----------------------------------------------------------------------------- a whole run


def test_a_run_on_a_femnist_file_with_natural_clients(tmp_path):
    write_femnist(tmp_path / "f.parquet", femnist_rows({f"f{i:04d}_00": 30 for i in range(4)}))
    history = fedsim.run(
        {
            "name": "hub",
            "seed": 0,
            "device": "cpu",
            "workers": 0,
            "rounds": 2,
            "clients_per_round": 4,
            "model": "mnist_cnn",
            "data": {
                "dataset": f"hf:{tmp_path / 'f.parquet'}",
                "hf": FEMNIST,
                "partition": "natural",
                "num_clients": 4,
            },
            "local": {"epochs": 1, "batch_size": 16, "lr": 0.05},
        },
        out=tmp_path / "run",
        quiet=True,
    )
    assert len(history.test_accuracy) == 2
    assert all(isinstance(a, float) and 0 <= a <= 1 for a in history.test_accuracy)


def test_the_command_line_prints_one_line_for_a_missing_column_and_an_unknown_key(tmp_path, femnist_file, capsys):
    base = {"name": "hub", "device": "cpu", "rounds": 1, "workers": 0, "clients_per_round": 2}
    data = {"dataset": femnist_file, "partition": "natural", "num_clients": 2}
    for options, expected in (
        ({**FEMNIST, "label": "label"}, "data.hf.label: no column 'label' in"),
        ({**FEMNIST, "colour": "red"}, "data.hf.colour: unknown key"),
    ):
        path = tmp_path / "hub.yaml"
        path.write_text(yaml.safe_dump({**base, "data": {**data, "hf": options}}))
        with pytest.raises(SystemExit) as info:
            main(["run", str(path), "--out", str(tmp_path / "run")])
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and err.startswith("fedsim: error: ") and "\n" not in err
        assert expected in err and not (tmp_path / "run").exists()
