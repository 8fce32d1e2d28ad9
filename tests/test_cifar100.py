"""CIFAR-100 (fedsim/data/cifar100.py) on small files pickled as the real ones, and the pachinko split."""

import os
import pickle
import stat
import struct

import numpy as np
import pytest
import torch
from support import Later

import fedsim
from fedsim.core.errors import ConfigError, DataError, FedsimError
from fedsim.data import DATASETS, PARTITIONS, load_dataset, partition
from fedsim.data.partition import pachinko
from fedsim.experiment.federation import load_federation
from fedsim.experiment.validation import load_config

torchvision = Later("torchvision")  # a second or more to import: only its tests pay for it

FOLDER = "cifar-100-python"
# the superclass of each of the 100 fine labels, in label order, as the real files have them
FINE_TO_COARSE = np.array(
    [4, 1, 14, 8, 0, 6, 7, 7, 18, 3, 3, 14, 9, 18, 7, 11, 3, 9, 7, 11, 6, 11, 5, 10, 7, 6, 13, 15, 3, 15]
    + [0, 11, 1, 10, 12, 14, 16, 9, 11, 5, 5, 19, 8, 8, 15, 13, 14, 17, 18, 10, 16, 4, 17, 4, 2, 0, 17, 4, 18, 17]
    + [10, 3, 2, 12, 12, 16, 12, 1, 9, 19, 2, 10, 0, 1, 16, 12, 9, 13, 15, 13, 16, 19, 2, 4, 6, 19, 5, 5, 8, 19]
    + [18, 1, 2, 15, 6, 0, 17, 8, 14, 13]
)
# the published channel statistics of the 50,000 training images, typed in again here
MEAN, STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


class Python2Pickler(pickle._Pickler):
    """Pickles as Python 2's cPickle wrote the CIFAR-100 files (protocol 2): every string as a
    Python 2 str (SHORT_BINSTRING / BINSTRING: bytes under encoding="bytes", str under torchvision's
    encoding="latin1"), numpy's array rebuilder under its Python 2 module numpy.core.multiarray, a
    dtype's arguments as the ints old numpy gave."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_python2_str(self, obj):
        raw = obj.encode("latin1") if isinstance(obj, str) else obj
        if len(raw) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(raw)]) + raw)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(raw)) + raw)
        self.memoize(obj)

    dispatch[str] = save_python2_str
    dispatch[bytes] = save_python2_str

    def save_global(self, obj, name=None):
        if getattr(obj, "__name__", None) == "_reconstruct":
            self.write(pickle.GLOBAL + b"numpy.core.multiarray\n_reconstruct\n")
            self.memoize(obj)
        else:
            super().save_global(obj, name)

    def reducer_override(self, obj):
        if isinstance(obj, np.dtype):
            cls, (code, align, copy), state = obj.__reduce__()
            return cls, (code, int(align), int(copy)), state
        return NotImplemented


def dump(path, entry):
    with open(path, "wb") as f:
        Python2Pickler(f, protocol=2).dump(entry)


def write_fake_cifar100(root, sizes=(("train", 60), ("test", 20)), seed=0):
    """A tiny cifar-100-python: train, test and meta with the real entries (rows of 1024 red,
    1024 green, 1024 blue bytes; fine labels with their real superclasses)."""
    folder = root / FOLDER
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    splits = {}
    for split, n in sizes:
        fine = rng.integers(0, 100, n)
        splits[split] = {
            "filenames": [f"{split}_{i}.png" for i in range(n)],
            "batch_label": f"{'training' if split == 'train' else 'testing'} batch 1 of 1",
            "fine_labels": fine.tolist(),
            "coarse_labels": FINE_TO_COARSE[fine].tolist(),
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        }
        dump(folder / split, splits[split])
    meta = {
        "fine_label_names": [f"fine_{i}" for i in range(100)],
        "coarse_label_names": [f"coarse_{i}" for i in range(20)],
    }
    dump(folder / "meta", meta)
    return splits, meta


def one_line_error(error, root, **kwargs):
    with pytest.raises(error) as info:
        load_dataset("cifar100", root, download=False, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


# ----------------------------------------------------------------------------- the files


def test_cifar100_reads_the_pickles_from_a_read_only_folder(tmp_path):
    splits, _ = write_fake_cifar100(tmp_path)
    folder = tmp_path / FOLDER
    os.chmod(folder, stat.S_IRUSR | stat.S_IXUSR)
    try:
        data = load_dataset("cifar100", tmp_path, download=False)
    finally:
        os.chmod(folder, stat.S_IRWXU)
    assert data.train_x.shape == (60, 3, 32, 32) and data.test_x.shape == (20, 3, 32, 32)
    assert data.train_x.dtype == torch.float32 and data.train_y.dtype == torch.int64 and data.num_classes == 100
    assert data.train_y.tolist() == splits["train"]["fine_labels"]
    assert data.test_y.tolist() == splits["test"]["fine_labels"]
    assert data.coarse_labels.dtype == torch.int64
    assert data.coarse_labels.tolist() == splits["train"]["coarse_labels"]
    for split, x in (("train", data.train_x), ("test", data.test_x)):
        raw = splits[split]["data"].astype(np.float64).reshape(-1, 3, 1024)  # 1024 red, 1024 green, 1024 blue
        expected = (raw / 255.0 - np.array(MEAN)[:, None]) / np.array(STD)[:, None]
        assert np.abs(x.reshape(-1, 3, 1024).numpy() - expected).max() < 1e-5  # float32 of values within +-2.1
    # image 7, green channel, row 3, column 5: byte 1024 + 32 * 3 + 5 of its row
    pixel = splits["train"]["data"][7][1024 + 32 * 3 + 5]
    assert data.train_x[7, 1, 3, 5].item() == pytest.approx((pixel / 255 - 0.4865) / 0.2564, abs=1e-5)


def test_the_generated_files_are_what_torchvision_reads(tmp_path, monkeypatch):
    splits, meta = write_fake_cifar100(tmp_path)
    folder = tmp_path / FOLDER
    raw = (folder / "train").read_bytes()
    assert raw[:2] == b"\x80\x02" and b"cnumpy.core.multiarray\n_reconstruct\n" in raw and b"U\x04data" in raw
    with open(folder / "train", "rb") as f:  # as the CIFAR page says to read them in Python 3
        as_bytes = pickle.load(f, encoding="bytes")
    assert set(as_bytes) == {b"filenames", b"batch_label", b"fine_labels", b"coarse_labels", b"data"}
    with open(folder / "meta", "rb") as f:
        assert set(pickle.load(f, encoding="bytes")) == {b"fine_label_names", b"coarse_label_names"}
    # torchvision's own reader, with its checksums of the real files switched off
    monkeypatch.setattr(torchvision.datasets.CIFAR100, "_check_integrity", lambda self: True)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda path, md5=None: True)
    theirs = torchvision.datasets.CIFAR100(str(tmp_path), train=True)
    ours = load_dataset("cifar100", tmp_path, download=False)
    assert theirs.targets == ours.train_y.tolist() and theirs.classes == meta["fine_label_names"]
    pixels = torch.from_numpy(theirs.data).permute(0, 3, 1, 2).float() / 255  # HWC to CHW
    assert torch.allclose(
        ours.train_x * torch.tensor(STD).view(3, 1, 1) + torch.tensor(MEAN).view(3, 1, 1), pixels, atol=1e-5
    )


def test_limit_keeps_the_first_samples_and_their_coarse_labels(tmp_path):
    splits, _ = write_fake_cifar100(tmp_path)
    data = load_dataset("cifar100", tmp_path, limit=7, download=False)
    assert data.coarse_labels.tolist() == splits["train"]["coarse_labels"][:7] and len(data.train_y) == 7


def python3_pickle(path, entry):
    with open(path, "wb") as f:
        pickle.dump(entry, f)


def test_a_python3_pickle_of_the_same_entries_reads_too(tmp_path):
    splits, meta = write_fake_cifar100(tmp_path)
    for name, entry in (*splits.items(), ("meta", meta)):
        python3_pickle(tmp_path / FOLDER / name, entry)
    assert load_dataset("cifar100", tmp_path, download=False).train_y.tolist() == splits["train"]["fine_labels"]


def break_entry(split, key, value):
    def change(splits, meta):
        entries = meta if split == "meta" else splits[split]
        if value is None:
            del entries[key]
        else:
            entries[key] = value(entries[key]) if callable(value) else value

    return change


def two_coarse_labels(splits, meta):
    coarse = splits["test"]["coarse_labels"]
    coarse[0] = (coarse[0] + 1) % 20  # fine label of test sample 0 now under a second superclass


def no_images(splits, meta):
    splits["test"].update(data=splits["test"]["data"][:0], fine_labels=[], coarse_labels=[])


MALFORMED = [
    ("no coarse labels", "train", break_entry("train", "coarse_labels", None), "no 'coarse_labels' entry"),
    ("no coarse names", "meta", break_entry("meta", "coarse_label_names", None), "no 'coarse_label_names' entry"),
    ("short rows", "train", break_entry("train", "data", lambda d: d[:, :3000]), "uint8 [N, 3072]"),
    ("float pixels", "test", break_entry("test", "data", lambda d: d.astype(np.float64)), "float64"),
    ("no images", "test", no_images, "holds no images"),
    (
        "fine label 100",
        "train",
        break_entry("train", "fine_labels", lambda y: y[:-1] + [100]),
        "fine_labels outside 0..99",
    ),
    ("coarse label 20", "test", break_entry("test", "coarse_labels", lambda y: [20] + y[1:]), "outside 0..19"),
    (
        "a label short",
        "train",
        break_entry("train", "fine_labels", lambda y: y[:-1]),
        "expected 60 integer fine_labels",
    ),
    ("text labels", "train", break_entry("train", "coarse_labels", lambda y: [str(v) for v in y]), "integer"),
    ("names not a list", "meta", break_entry("meta", "fine_label_names", 100), "list of names"),
    ("fine under two", FOLDER, two_coarse_labels, "under coarse labels"),
]


@pytest.mark.parametrize("what, where, change, says", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_files_are_refused_in_one_line(tmp_path, what, where, change, says):
    splits, meta = write_fake_cifar100(tmp_path)
    change(splits, meta)
    for name, entry in (*splits.items(), ("meta", meta)):
        dump(tmp_path / FOLDER / name, entry)
    message = one_line_error(DataError, tmp_path)
    assert says in message and where in message, message


def test_a_damaged_file_or_one_that_runs_code_is_refused_in_one_line(tmp_path):
    write_fake_cifar100(tmp_path)
    (tmp_path / FOLDER / "test").write_bytes((tmp_path / FOLDER / "test").read_bytes()[:500])  # truncated
    assert "test: cannot read this CIFAR-100 file" in one_line_error(DataError, tmp_path)
    (tmp_path / FOLDER / "test").write_bytes(b"cos\nsystem\n(S'echo hi'\ntR.")  # os.system("echo hi")
    assert "os.system" in one_line_error(DataError, tmp_path)
    (tmp_path / FOLDER / "meta").write_bytes(pickle.dumps([1, 2]))
    assert "meta: not a CIFAR-100 file (holds a list" in one_line_error(DataError, tmp_path)


def test_missing_files_fail_in_one_line_with_and_without_a_download(tmp_path, monkeypatch):
    assert one_line_error(DataError, tmp_path).startswith("data.root: no CIFAR100 files in ")

    def no_network(root, train, download):
        raise RuntimeError(
            "Error downloading cifar-100-python.tar.gz:\n<urlopen error [Errno -2] Name or service not known>\n"
        )

    monkeypatch.setattr(torchvision.datasets, "CIFAR100", no_network)
    with pytest.raises(DataError) as info:
        load_dataset("cifar100", tmp_path / "empty")
    assert "\n" not in str(info.value) and FOLDER in str(info.value) and "Name or service" in str(info.value)


def test_cifar100_and_pachinko_are_registered():
    assert "100 classes in 20 coarse labels" in dict(DATASETS.describe())["cifar100"]
    assert "Dir(data.alpha)" in dict(PARTITIONS.describe())["pachinko"]


# ----------------------------------------------------------------------------- the pachinko split

LABELS = np.random.default_rng(0).permutation(np.repeat(np.arange(100), 500))  # CIFAR-100's 500 per label
COARSE = FINE_TO_COARSE[LABELS]


def reddi(seed=1, **options):
    """The split of Reddi et al.: 500 clients of 100 training samples."""
    options = {"alpha": 0.1, "beta": 10.0, **options}
    parts = partition(LABELS, "pachinko", 500, seed, {"coarse_labels": torch.from_numpy(COARSE)}, **options)
    return [p.numpy() for p in parts]


def simpson(counts):
    """An unbiased estimate of sum(p_i^2) from multinomial counts (last axis) of its p."""
    total = counts.sum(-1)
    return (counts * (counts - 1)).sum(-1) / (total * (total - 1))


def test_reddi_split_gives_every_client_100_samples_concentrated_on_few_coarse_labels():
    # Each of the first 100 clients draws Dir(alpha) shares of the 20 coarse labels and 100
    # samples by them (they take 10,000 of 50,000 samples: no label runs out before them, so
    # their shares are Dir(alpha) over all 20). A coarse label of share t is missed with
    # probability (1 - t)^100, whose mean under Beta(alpha, 19 alpha) is the product below.
    for alpha, parts in ((0.1, reddi()), (100.0, reddi(alpha=100.0))):
        assert [len(p) for p in parts] == [100] * 500
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(50_000))
        distinct = np.array([len(np.unique(COARSE[p])) for p in parts[:100]])
        missed = np.prod([(19 * alpha + j) / (20 * alpha + j) for j in range(100)])
        assert abs(distinct.mean() - 20 * (1 - missed)) < 4 * distinct.std() / 10 + 0.01, (alpha, distinct.mean())
        if alpha == 0.1:
            few = distinct.mean()
    assert few < 8 < 19.5 < distinct.mean()  # 6.9 against 19.87 expected


def test_fine_labels_spread_evenly_within_a_coarse_label_as_beta_grows():
    # Within a coarse label a client's fine-label shares are Dir(beta) over its 5 fine labels, so
    # E[sum of squared shares] = (beta + 1) / (5 beta + 1); each (client, coarse label) with two
    # samples or more estimates it without bias.
    means = []
    for beta in (0.1, 10.0, 1000.0):
        parts = reddi(beta=beta)[:100]
        counts = np.stack([np.bincount(LABELS[p], minlength=100) for p in parts])  # [clients, fine]
        within = np.stack([counts[:, c == FINE_TO_COARSE] for c in range(20)], axis=1)  # [clients, coarse, 5]
        estimates = simpson(within[within.sum(-1) >= 2])
        assert abs(estimates.mean() - (beta + 1) / (5 * beta + 1)) < 4 * estimates.std() / np.sqrt(len(estimates))
        means.append(estimates.mean())
    assert means[0] > 0.6 > 0.3 > means[1] > means[2] > 0.19  # 0.733, 0.216, 0.200 expected


def test_pachinko_is_seeded():
    first, again, other = reddi(seed=4), reddi(seed=4), reddi(seed=5)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


# two superclasses (labels 7 and 3) over five fine labels of 3, 1, 2, 4 and 2 samples
TINY_FINE = np.repeat([10, 11, 12, 13, 14], [3, 1, 2, 4, 2])
TINY_COARSE = np.array([7, 7, 3, 3, 3])[TINY_FINE - 10]


def one_at_a_time(labels, coarse_labels, num_clients, alpha, beta, rng):
    """TFF's description taken literally: one client after another, one sample at a time,
    an emptied fine label struck from the tree and from the client's shares."""
    pools = {f: list(rng.permutation(np.flatnonzero(labels == f))) for f in np.unique(labels)}
    tree = {c: [f for f in pools if coarse_labels[labels == f][0] == c] for c in np.unique(coarse_labels)}
    parts = []
    for _ in range(num_clients):
        coarse = list(tree)
        coarse_share = list(rng.dirichlet([alpha] * len(coarse)))
        fine_share = {c: list(rng.dirichlet([beta] * len(tree[c]))) for c in coarse}
        part = []
        for _ in range(len(labels) // num_clients):
            i = rng.choice(len(coarse), p=np.array(coarse_share) / sum(coarse_share))
            c = coarse[i]
            j = rng.choice(len(tree[c]), p=np.array(fine_share[c]) / sum(fine_share[c]))
            f = tree[c][j]
            part.append(pools[f].pop())
            if not pools[f]:
                del tree[c][j], fine_share[c][j]
                if not tree[c]:
                    del tree[c], coarse[i], coarse_share[i]
        parts.append(part)
    return parts


def fine_counts(parts):
    return np.stack([np.bincount(TINY_FINE[p] - 10, minlength=5) for p in parts])


def test_emptied_labels_still_give_exact_sizes():
    for seed in range(200):
        for alpha, beta in ((0.01, 0.01), (1.0, 100.0)):
            parts = pachinko(TINY_FINE, 3, np.random.default_rng(seed), TINY_COARSE, alpha=alpha, beta=beta)
            assert [len(p) for p in parts] == [4, 4, 4]
            assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(12))
    parts = pachinko(TINY_FINE, 5, np.random.default_rng(0), TINY_COARSE, alpha=0.5, beta=1.0)
    assert [len(p) for p in parts] == [2] * 5 and len(np.unique(np.concatenate(parts))) == 10  # 2 to nobody


@pytest.mark.slow
def test_drawing_in_batches_matches_drawing_one_at_a_time():
    # The mean count of each fine label at each client, over many seeds: the batched draws and
    # the literal one-at-a-time process must agree within the standard error of their difference.
    runs, options = 3000, {"alpha": 0.5, "beta": 1.0}
    ours = np.stack(
        [fine_counts(pachinko(TINY_FINE, 3, np.random.default_rng(s), TINY_COARSE, **options)) for s in range(runs)]
    )
    literal = np.stack(
        [
            fine_counts(one_at_a_time(TINY_FINE, TINY_COARSE, 3, rng=np.random.default_rng(10**6 + s), **options))
            for s in range(runs)
        ]
    )
    error = np.sqrt((ours.var(0) + literal.var(0)) / runs)
    assert (np.abs(ours.mean(0) - literal.mean(0)) <= 4.5 * error + 1e-12).all()


def test_pachinko_options_and_labels_are_checked_in_one_line():
    for options, key in (
        ({"alpha": 0.0}, "data.alpha"),
        ({"beta": float("inf")}, "data.beta"),
        ({"alpha": "x"}, "data.alpha"),
    ):
        with pytest.raises(ConfigError, match=f"^{key}: must be a finite number > 0"):
            pachinko(TINY_FINE, 3, np.random.default_rng(0), TINY_COARSE, **options)
    twice = TINY_COARSE.copy()
    twice[0] = 3  # one sample of label 10 under superclass 3, the others under 7
    with pytest.raises(ConfigError, match="label 10 is under several") as info:
        pachinko(TINY_FINE, 3, np.random.default_rng(0), twice)
    assert "\n" not in str(info.value)


def test_pachinko_needs_coarse_labels_and_runs_on_cifar100(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_federation(load_config({"data": {"dataset": "synthetic", "partition": "pachinko", "num_clients": 10}}))
    message = str(info.value)
    assert "\n" not in message and message.startswith("data.partition: pachinko needs a dataset with coarse labels")
    with pytest.raises(FedsimError, match="coarse labels"):
        fedsim.run(
            {"data": {"dataset": "synthetic", "partition": "pachinko"}, "rounds": 1}, out=tmp_path / "run", quiet=True
        )
    write_fake_cifar100(tmp_path)
    data = {"dataset": "cifar100", "root": str(tmp_path), "download": False, "partition": "pachinko", "num_clients": 7}
    federation = load_federation(load_config({"data": {**data, "alpha": 0.1}, "clients_per_round": 7}))
    assert [len(p) for p in federation.parts] == [60 // 7] * 7  # 4 samples to nobody
    assert len(federation.parts.indices.unique()) == 56
