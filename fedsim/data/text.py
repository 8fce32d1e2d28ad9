"""Text as a token-level task: tokenizers, and running text cut into windows of next-token targets.

A text dataset holds int64 token ids ``[N, T]`` and, at each position, the id of the token that
follows (``IGNORE_INDEX`` where nothing is scored): causal language modelling as GPT trains it
(Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"), federated with one
client per speaker as LEAF's Shakespeare (Caldas et al. 2018, "LEAF: A Benchmark for Federated
Settings"), here on whole sequences rather than one character a sample. ``data.tokenizer`` says
how text becomes ids: ``bytes`` (UTF-8 bytes as ids 0..255, a byte-level vocabulary as in Xue et
al. 2022, "ByT5: Towards a Token-Free Future with Pre-trained Byte-to-Byte Models") or ``hf:<hub
name or folder>``, a tokenizer of the ``transformers`` library (Wolf et al. 2020), imported only then.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.errors import ConfigError, DataError, cut, install
from . import hub
from .leaf_plays import TRAIN_FRACTION, read_roles, split_role
from .tensors import IGNORE_INDEX, Dataset

BYTES = "bytes"
HF = "hf:"
FORMS = [  # what data.tokenizer may say
    (BYTES, "UTF-8 bytes, 256 ids, built in"),
    (f"{HF}<name or folder>", "a transformers tokenizer from the hub or a folder (fedsim-sync[llm])"),
]
INSTALL = install("llm")
_FIELD = re.compile(r"[^.\[\]{}!:]+")  # a template's {column}: no attribute, index or nested field


class Tokenizer:
    """What fedsim asks of a tokenizer: the ids of a text and the text of ids, the vocabulary's
    size, the id that pads a short sequence, and the id that ends a document (None: none)."""

    name: str
    vocab_size: int
    pad_id: int
    eos_id: int | None

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The ids of each text; a tokenizer that encodes many texts at once faster says so here."""
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255; padding is id 0 (the NUL byte, absent from text), no end id."""

    name, vocab_size, pad_id, eos_id = BYTES, 256, 0, None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        return np.asarray(ids).astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HubTokenizer(Tokenizer):
    """A ``transformers`` tokenizer: its vocabulary with the added tokens (``len``), padding by its
    pad token, else its end-of-text token, else id 0. No special tokens are added to a text: the
    end-of-text id between documents is the only one (see :func:`windows`)."""

    def __init__(self, name: str, tokenizer: Any):
        self.name, self._tokenizer = name, tokenizer
        self.vocab_size = len(tokenizer)
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        if not texts:
            return []
        # verbose=False: a document longer than the model's context is expected here, it is cut later
        encoded = self._tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
        return [np.asarray(ids, dtype=np.int64) for ids in encoded]

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        return self._tokenizer.decode(np.asarray(ids).tolist())


def check_tokenizer_spec(spec: object) -> None:
    """``data.tokenizer`` is ``bytes`` or ``hf:`` and a hub name or a path (not loaded here)."""
    if spec == BYTES:
        return
    if not (isinstance(spec, str) and spec.startswith(HF) and spec[len(HF) :].strip()):
        raise ConfigError(
            f"data.tokenizer: must be bytes or hf:<hub name or tokenizer folder> (hf:gpt2, hf:./my-tokenizer), "
            f"got {cut(repr(spec))}"
        )


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names: a folder is read from its files alone; a hub name
    from the hub, or from the Hugging Face cache where the hub is out of reach (one line at once
    where it is not cached, rather than the library's retries)."""
    check_tokenizer_spec(spec)
    if spec == BYTES:
        return ByteTokenizer()
    target = spec[len(HF) :]
    try:
        import huggingface_hub.constants as constants
        import transformers
    except ImportError:
        raise DataError(f"data.tokenizer: {spec} needs transformers: {INSTALL}") from None
    path = Path(target).expanduser()
    if path.is_dir():
        return HubTokenizer(spec, _from_pretrained(transformers, str(path), spec, "this folder", local=True))
    if path.exists() or target.startswith(("/", ".", "~")):
        raise DataError(f"data.tokenizer: {spec}: no such folder (a tokenizer folder holds tokenizer.json or the like)")
    offline = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else None
    unreachable = offline or hub.hub_unreachable(constants.ENDPOINT)
    if not unreachable:
        return HubTokenizer(spec, _from_pretrained(transformers, target, spec, "the hub", local=False))
    why = offline or f"the hub is out of reach ({unreachable})"
    where = f"the Hugging Face cache ({constants.HF_HUB_CACHE}), and {why}"
    fix = "; download it first with network, or give a local folder (hf:/path/to/tokenizer)"
    return HubTokenizer(spec, _from_pretrained(transformers, target, spec, where, local=True, fix=fix))


def _from_pretrained(transformers: Any, target: str, spec: str, where: str, local: bool, fix: str = "") -> Any:
    try:
        return transformers.AutoTokenizer.from_pretrained(target, local_files_only=local)
    except Exception as e:  # the library raises OSError, ValueError and its own for what it cannot find or read
        raise DataError(
            f"data.tokenizer: {spec}: no tokenizer loads from {where} ({hub.failure_reason(e)}){fix}"
        ) from None


# ----------------------------------------------------------------------------- windows


def windows(
    documents: Sequence[Sequence[str]], tokenizer: Tokenizer, sequence_length: int
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Each client's documents (``documents[c]``) as sequences of ``sequence_length`` tokens.

    A client's documents are encoded and joined, the tokenizer's end id between two of them
    where it has one, then cut into windows of ``sequence_length + 1`` tokens at a stride of
    ``sequence_length``: a window's inputs are its first ``sequence_length`` tokens and its
    targets its last, so every token but a client's first is a target exactly once. The last
    window is padded (inputs by ``pad_id``, targets by IGNORE_INDEX); a client of fewer than 2
    tokens has none. Returns inputs and targets, int64 ``[N, sequence_length]``, and each
    window's client (int64 ``[N]``, an index into ``documents``), clients in order."""
    length = sequence_length
    encoded = tokenizer.encode_batch([text for texts in documents for text in texts])
    inputs, targets, owners, at = [], [], [], 0
    for client, texts in enumerate(documents):
        ids = _joined(encoded[at : at + len(texts)], tokenizer.eos_id)
        at += len(texts)
        count = -(-(len(ids) - 1) // length) if len(ids) > 1 else 0
        x = np.full(count * length, tokenizer.pad_id, dtype=np.int64)
        y = np.full(count * length, IGNORE_INDEX, dtype=np.int64)
        x[: len(ids) - 1], y[: len(ids) - 1] = ids[:-1], ids[1:]
        inputs.append(x)
        targets.append(y)
        owners.append(np.full(count, client, dtype=np.int64))
    if not inputs:
        return (
            torch.empty((0, length), dtype=torch.int64),
            torch.empty((0, length), dtype=torch.int64),
            np.empty(0, np.int64),
        )
    x, y = (torch.from_numpy(np.concatenate(parts).reshape(-1, length)) for parts in (inputs, targets))
    return x, y, np.concatenate(owners)


def _joined(encoded: list[np.ndarray], eos_id: int | None) -> np.ndarray:
    if eos_id is None or len(encoded) < 2:
        return np.concatenate(encoded) if encoded else np.empty(0, dtype=np.int64)
    separator = np.array([eos_id], dtype=np.int64)
    return np.concatenate([part for ids in encoded for part in (separator, ids)][1:])


def split_by_time(owners: np.ndarray, train_fraction: float = TRAIN_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """Which windows train and which test, per client in order, as LEAF splits a role by time
    (``split_role``): the first ``max(1, int(fraction x n))`` of a client's n windows train and
    the rest test. No gap is left between them, since no two windows share a target. A client
    without a window in each split keeps none (LEAF drops such roles). Boolean masks over
    ``owners``, whose clients' windows must be consecutive."""
    clients, starts, counts = np.unique(owners, return_index=True, return_counts=True)
    firsts = np.array([len(split_role(int(n), train_fraction, gap=0)[0]) for n in counts], dtype=np.int64)
    kept = counts > firsts
    position = np.arange(len(owners)) - np.repeat(starts, counts)
    train = np.repeat(kept, counts) & (position < np.repeat(firsts, counts))
    return train, np.repeat(kept, counts) & ~train


def text_dataset(
    train: tuple[torch.Tensor, torch.Tensor, np.ndarray],
    test: tuple[torch.Tensor, torch.Tensor, np.ndarray],
    vocab_size: int,
    name: str,
    client_names: Sequence[str] | None = None,
) -> Dataset:
    """A Dataset of windows (inputs, targets, clients) of the training and test text; with
    ``client_names`` the clients are the data's own, renumbered to those that hold a window."""
    data = Dataset(train[0], train[1], test[0], test[1], vocab_size, name)
    if client_names is not None:
        kept, ids = np.unique(np.concatenate([train[2], test[2]]), return_inverse=True)
        ids = torch.from_numpy(ids.reshape(-1).astype(np.int64))
        data.train_clients, data.test_clients = ids[: len(train[2])], ids[len(train[2]) :]
        data.client_names = tuple(client_names[i] for i in kept)
    return data


def plays_text(
    folder: Path, tokenizer: Tokenizer, sequence_length: int, train_fraction: float = TRAIN_FRACTION
) -> Dataset:
    """The roles of the plays in ``folder`` (``read_roles``: LEAF's roles and their text) as
    running text, one client per role; each role's windows split by time (``split_by_time``)."""
    roles = read_roles(folder)
    names = sorted(roles)
    x, y, owners = windows([[roles[name]] for name in names], tokenizer, sequence_length)
    train, test = split_by_time(owners, train_fraction)
    if not train.any():
        raise DataError(
            f"shakespeare_text: no role in {folder} has more than one sequence of {sequence_length} tokens (one to "
            f"train, one to test); lower data.sequence_length, or check that the texts are plays"
        )
    parts = [(x[mask], y[mask], owners[mask]) for mask in (train, test)]
    return text_dataset(*parts, tokenizer.vocab_size, "shakespeare_text", client_names=names)


# ----------------------------------------------------------------------------- hf: text datasets


def template_fields(text: str) -> list[str] | None:
    """The columns a template of ``data.hf.text`` names (``"{instruction}\\n{response}"``), or
    None where ``text`` is one column's name; one line for a template that cannot be filled."""
    if "{" not in text and "}" not in text:
        return None
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(text) if field is not None]
    except ValueError as e:
        raise ConfigError(
            f"data.hf.text: {e} in the template {cut(repr(text))}; write a brace as {{{{ or }}}}"
        ) from None
    wrong = next((field for field in fields if not _FIELD.fullmatch(field) or field.isdigit()), None)
    if not fields or wrong is not None:
        raise ConfigError(
            f"data.hf.text: every {{...}} of a template must name a column ({{instruction}}), got "
            f"{cut(repr(wrong if fields else text))}"
        )
    return list(dict.fromkeys(fields))


def load_hub_text(spec: str, options: dict | None, tokenizer: Tokenizer, sequence_length: int) -> Dataset:
    """An ``hf:`` dataset whose ``data.hf.text`` is a column of text or a template over columns
    (an instruction and its response laid out as Stanford Alpaca's prompt, Taori et al. 2023, or
    Dolly's, Conover et al. 2023, are fed to a causal model): each row a document, each client's
    documents (``data.hf.client``; else all of them) cut into windows. Its test split where it
    has one, else ``test_fraction`` of each client's documents held out (hub.py's split), so
    that no test token is read in training."""
    opts = hub.parse_options(options)
    train, test = hub.pick_splits(hub.read_splits(spec, hub.import_datasets(spec)), opts, spec)
    tables = [train.with_format("arrow")[:]] + ([test.with_format("arrow")[:]] if test is not None else [])
    texts = [_documents(table, opts["text"], spec) for table in tables]
    owners = [_owners(table, opts["client"], spec) for table in tables] if opts["client"] else None
    if test is None:
        held = hub.hold_out(len(texts[0]), owners[0] if owners else None, opts["test_fraction"])
        if not held.any():
            hub.fail("test_fraction", f"holds out none of the {len(held)} documents; raise it, or give a test split")
        texts = [texts[0][~held], texts[0][held]]
        owners = [owners[0][~held], owners[0][held]] if owners else None
    ids, names = hub.client_ids(owners) if owners else ([np.zeros(len(t), dtype=np.int64) for t in texts], None)
    count = len(names) if names else 1
    parts = []
    for split, documents, owner in zip((opts["train"], opts["test"] if test is not None else "held out"), texts, ids):
        order = np.argsort(owner, kind="stable")  # each client's documents together, in their order
        groups = np.split(documents[order], np.cumsum(np.bincount(owner, minlength=count))[:-1])
        parts.append(windows([group.tolist() for group in groups], tokenizer, sequence_length))
        if len(parts[-1][0]) == 0:
            hub.fail("text", f"the split {split!r} of {spec} has no client with 2 tokens or more (to read, to predict)")
    return text_dataset(parts[0], parts[1], tokenizer.vocab_size, spec, client_names=names)


def _documents(table: Any, text: str, spec: str) -> np.ndarray:
    """The text of each row: the column ``text``, or the template filled from its columns."""
    fields = template_fields(text)
    for column in fields or [text]:
        if column not in table.column_names:
            hub.fail("text", f"no column {column!r} in {spec}; its columns: {', '.join(table.column_names)}")
    if fields is None:
        kind = table.schema.field(text).type
        if str(kind) not in ("string", "large_string", "string_view"):
            hub.fail("text", f"column {text!r} holds {kind}, not text; name a text column or write a template")
        return np.asarray(hub.column_values(table, text, "text"), dtype=object)
    columns = [hub.column_values(table, column, "text").tolist() for column in fields]
    return np.array([text.format_map(dict(zip(fields, row))) for row in zip(*columns)], dtype=object)


def _owners(table: Any, column: str, spec: str) -> np.ndarray:
    if column not in table.column_names:
        hub.fail("client", f"no column {column!r} in {spec}; its columns: {', '.join(table.column_names)}")
    return hub.column_values(table, column, "client")
