"""Splitting a dataset among clients.

A partition method is one registered function ``method(labels, num_clients, rng, **options)``
that returns one index array per client (or a ``Parts``, which holds them as one). ``labels`` is
a numpy int array and ``rng`` a seeded ``numpy.random.Generator``; options are keyword arguments
named like the ``data.*`` keys, and a bad value raises ConfigError naming its key. A method that
needs more of each sample than its label names the dataset's column as a parameter (``clients``:
its own clients, for ``natural``; ``coarse_labels``: CIFAR-100's superclasses, for
``pachinko``), and gets it as a numpy array.
The parts are disjoint and together cover the data, except where a method's description says
otherwise (``label_k``, ``natural`` with fewer clients than the data has, ``pachinko``).
"""

from __future__ import annotations

import inspect
import math
import operator
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from ..core.checks import is_integer, is_number, refuse_unknown
from ..core.errors import ConfigError
from ..core.registry import Registry
from ..core.streams import partition_rng, test_split_rng

PARTITIONS = Registry("partition")

MAX_DIRICHLET_DRAWS = 1000  # re-draws allowed to meet data.min_samples before giving up


# the methods that read no label: what a split of text, whose samples have none, may use
WITHOUT_LABELS = {"natural", "iid", "contiguous", "quantity"}

COLUMNS = {
    "clients": "its own clients (a federated dataset: femnist, shakespeare, hf: with a client column)",
    "coarse_labels": "coarse labels (cifar100)",
}  # what a method may ask of each sample


class Parts(Sequence):
    """One int64 index tensor per client, held as one flat tensor of indices and the offsets at
    which each client's begin (client c owns ``indices[offsets[c]:offsets[c + 1]]``): a million
    clients are two tensors, not a million, and a client's part is a view, made when asked for."""

    def __init__(self, indices: torch.Tensor, offsets: torch.Tensor):
        self.indices, self.offsets = indices, offsets

    @classmethod
    def of(cls, parts: Sequence[np.ndarray | torch.Tensor]) -> Parts:
        """The parts of a list of index arrays (or tensors), in its order."""
        sizes = np.fromiter(map(len, parts), np.int64, count=len(parts))
        indices = np.concatenate(parts) if len(parts) else np.zeros(0, np.int64)
        return cls.of_sizes(indices, sizes)

    @classmethod
    def of_sizes(cls, indices: np.ndarray, sizes: np.ndarray) -> Parts:
        """``indices`` cut into consecutive parts of ``sizes``."""
        offsets = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        return cls(torch.as_tensor(indices, dtype=torch.int64), torch.from_numpy(offsets))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, client: int) -> torch.Tensor:
        client = operator.index(client)
        if client < 0:
            client += len(self)
        if not 0 <= client < len(self):
            raise IndexError(f"client {client} of {len(self)}")
        return self.indices[int(self.offsets[client]) : int(self.offsets[client + 1])]

    def sizes(self) -> torch.Tensor:
        """Each client's number of samples."""
        return self.offsets.diff()

    def firsts(self) -> torch.Tensor:
        """Each client's first index (every part must hold one)."""
        return self.indices[self.offsets[:-1]]


def partition(
    labels: torch.Tensor | np.ndarray,
    method: str,
    num_clients: int,
    seed: int,
    columns: dict[str, torch.Tensor] | None = None,
    **options: Any,
) -> list[torch.Tensor]:
    """Split sample indices among ``num_clients`` clients; one int64 tensor per client.
    ``columns``: the dataset's per-sample columns (``Dataset.columns()``), for the methods that
    name them. Token data's targets ([N, T]) are no labels: only ``WITHOUT_LABELS`` split it."""
    return list(split(labels, method, num_clients, seed, columns, **options))


def split(
    labels: torch.Tensor | np.ndarray,
    method: str,
    num_clients: int,
    seed: int,
    columns: dict[str, torch.Tensor] | None = None,
    **options: Any,
) -> Parts:
    """``partition``'s parts as one Parts, as a run holds them: no tensor per client."""
    fn = PARTITIONS.get(method)
    labels = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels)
    if labels.ndim > 1 and method not in WITHOUT_LABELS:
        raise ConfigError(
            f"data.partition: {method} splits by class labels; text data has none: use natural or iid "
            f"(or {', '.join(sorted(WITHOUT_LABELS - {'natural', 'iid'}))})"
        )
    if not is_integer(num_clients) or num_clients < 1:
        raise _invalid("num_clients", "an integer >= 1", num_clients)
    if num_clients > len(labels):
        raise ConfigError(f"data.num_clients: {num_clients} clients but only {len(labels)} samples")
    refuse_unknown("data.partition", method, options, sorted(partition_options(method)))
    for name in set(inspect.signature(fn).parameters) & set(COLUMNS):
        if name not in (columns or {}):
            raise ConfigError(f"data.partition: {method} needs a dataset with {COLUMNS[name]}; this one has none")
        options[name] = np.asarray(columns[name].cpu())
    parts = fn(labels, num_clients, partition_rng(seed), **options)
    return parts if isinstance(parts, Parts) else Parts.of(parts)


def partition_options(method: str) -> set[str]:
    """The ``data.*`` options a partition method takes: its parameters, but for what every method
    is given (labels, num_clients, rng) and the dataset's columns."""
    return set(inspect.signature(PARTITIONS.get(method)).parameters) - {"labels", "num_clients", "rng", *COLUMNS}


def columns_needed(method: str) -> set[str]:
    """The columns of its own (COLUMNS) a dataset needs for the partition method."""
    return set(inspect.signature(PARTITIONS.get(method)).parameters) & set(COLUMNS)


def options_for(method: str, data_config: Any) -> dict:
    """The ``data.*`` values that a partition method takes, read from a DataConfig."""
    return {
        name: getattr(data_config, name) for name in sorted(partition_options(method)) if hasattr(data_config, name)
    }


def samples_of(clients: np.ndarray, kept: np.ndarray) -> Parts:
    """The ascending sample indices of each client in ``kept``, in the order of ``kept``: one
    sort of the samples and no step per client, so a million clients cost what one costs times
    a log."""
    order = np.argsort(clients, kind="stable")
    starts = np.searchsorted(clients[order], kept, side="left")
    sizes = np.searchsorted(clients[order], kept, side="right") - starts
    # position j of the flat result is sample order[starts[c] + j - (where client c's run begins)]
    begins = np.cumsum(sizes) - sizes
    return Parts.of_sizes(order[np.repeat(starts - begins, sizes) + np.arange(sizes.sum())], sizes)


def natural_test_split(kept: torch.Tensor, test_clients: torch.Tensor) -> Parts:
    """Each client's own test samples, for parts of ``natural`` (``kept``: each part's own client):
    the test samples of the same writer, role or user (none for a client the data holds no test
    sample of)."""
    return samples_of(np.asarray(test_clients.cpu()), np.asarray(kept.cpu()))


def local_test_split(
    train_labels: torch.Tensor | np.ndarray,
    parts: Sequence[torch.Tensor | np.ndarray],
    test_labels: torch.Tensor | np.ndarray,
    seed: int,
) -> list[torch.Tensor]:
    """Per-client test indices drawn from each client's own label distribution.

    Every class's test samples are divided among the clients in proportion to how many
    training samples of that class each client holds, so a client's test split has its
    training label mix and sizes follow training sizes. The splits are disjoint; test samples
    of a class that no client trains on are left out. Token data has no labels: its test
    sequences are dealt as those of one class, in proportion to each client's training size.
    """
    train_labels, test_labels = (
        np.asarray(t.cpu() if isinstance(t, torch.Tensor) else t) for t in (train_labels, test_labels)
    )
    if train_labels.ndim > 1:
        train_labels, test_labels = np.zeros(len(train_labels), np.int64), np.zeros(len(test_labels), np.int64)
    classes, test_sizes = np.unique(test_labels, return_counts=True)
    width = int(max(train_labels.max(initial=0), classes.max(initial=0))) + 1
    held = np.stack([np.bincount(train_labels[np.asarray(p)], minlength=width) for p in parts], axis=1)[classes]
    share = held / np.maximum(held.sum(axis=1, keepdims=True), 1)
    counts = _split_counts(share, test_sizes * (held.sum(axis=1) > 0))
    rng = test_split_rng(seed)  # a stream apart from the training split's
    return [torch.as_tensor(p, dtype=torch.int64) for p in _deal_by_class(test_labels, counts, rng)]


# ----------------------------------------------------------------------------- helpers


def _invalid(key: str, allowed: str, got) -> ConfigError:
    return ConfigError(f"data.{key}: must be {allowed}, got {got!r}")


def _check_positive(key: str, value) -> None:
    if not (is_number(value) and value > 0):
        raise _invalid(key, "a finite number > 0", value)


def _split_counts(shares: np.ndarray, totals) -> np.ndarray:
    """Integer counts along the last axis summing exactly to ``totals``, each within one of
    share x total: rounding the cumulative sums (not each share) keeps the sum exact."""
    totals = np.asarray(totals)
    bounds = np.round(np.cumsum(shares, axis=-1) * totals[..., None]).astype(np.int64)
    bounds[..., -1] = totals
    return np.diff(bounds, axis=-1, prepend=0)


def _shuffled_by_class(labels: np.ndarray, rng) -> np.ndarray:
    """All indices sorted by label, in random order within each class."""
    order = rng.permutation(len(labels))
    return order[np.argsort(labels[order], kind="stable")]


def _deal_by_class(labels: np.ndarray, counts: np.ndarray, rng) -> list[np.ndarray]:
    """Index arrays from ``counts[c, j]``, the samples of the c-th class (in sorted label order)
    that client j gets. Each class is shuffled before it is dealt; a class's samples beyond
    its row total go to nobody."""
    order = _shuffled_by_class(labels, rng)
    num_clients = counts.shape[1]
    class_sizes = np.unique(labels, return_counts=True)[1]
    with_nobody = np.column_stack([counts, class_sizes - counts.sum(axis=1)])
    owner_ids = np.tile(np.append(np.arange(num_clients), -1), len(class_sizes))
    owner = np.empty(len(labels), dtype=np.int64)
    owner[order] = np.repeat(owner_ids, with_nobody.ravel())
    return _parts_from_owner(owner, num_clients)


def _parts_from_owner(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """One ascending index array per client from each sample's owner (-1: nobody)."""
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner[owner >= 0], minlength=num_clients)
    assigned = order[np.count_nonzero(owner < 0) :]
    return np.split(assigned, np.cumsum(counts)[:-1])


# ----------------------------------------------------------------------------- methods


@PARTITIONS.register(
    "natural",
    "the dataset's own clients (a writer, a role, a user); data.num_clients of them, a seeded "
    "subset when the data has more",
)
def natural(labels: np.ndarray, num_clients: int, rng: np.random.Generator, clients: np.ndarray) -> Parts:
    """All the dataset's clients when ``num_clients`` is their number, else a seeded draw of
    that many; client i of the run is the i-th kept, in the dataset's order of ids."""
    ids = np.unique(clients)
    if num_clients > len(ids):
        raise ConfigError(
            f"data.num_clients: {num_clients:,} clients asked for, but the data has {len(ids):,} clients of its own "
            f"(data.partition: natural); use at most {len(ids):,}"
        )
    kept = ids if num_clients == len(ids) else np.sort(rng.choice(ids, num_clients, replace=False))
    return samples_of(clients, kept)


@PARTITIONS.register("iid", "seeded random split into equal parts (sizes differ by at most one)")
def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return np.array_split(rng.permutation(len(labels)), num_clients)


@PARTITIONS.register(
    "gamma_similarity",
    "a random data.gamma share of the samples split at random, the rest sorted by label and cut into "
    "consecutive parts (ByzFL's gamma similarity; 1: iid, 0: by label)",
)
def gamma_similarity(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, gamma: float = 0.5
) -> list[np.ndarray]:
    """ByzFL's ``gamma_similarity_niid`` (Allouah et al. 2023): a random floor(gamma N) of the samples
    (ByzFL's: the first of its random train split) are shuffled and split into equal parts; the
    others, sorted by label (then by position), are cut into equal consecutive parts; each client
    gets one part of each. Each cut gives its first clients the one sample more, so sizes differ by
    at most two, as ByzFL's do."""
    if not is_number(gamma) or not 0 <= gamma <= 1:
        raise _invalid("gamma", "a number in [0, 1]", gamma)
    order = rng.permutation(len(labels))
    similar = int(Fraction(str(gamma)) * len(labels))
    rest = np.sort(order[similar:])
    by_label = rest[np.argsort(labels[rest], kind="stable")]
    shuffled = np.array_split(rng.permutation(order[:similar]), num_clients)
    return [np.sort(np.concatenate([a, b])) for a, b in zip(shuffled, np.array_split(by_label, num_clients))]


@PARTITIONS.register("contiguous", "consecutive ranges in dataset order; the last client takes the remainder")
def contiguous(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    size = len(labels) // num_clients
    bounds = [i * size for i in range(num_clients)] + [len(labels)]
    return [np.arange(bounds[i], bounds[i + 1]) for i in range(num_clients)]


@PARTITIONS.register(
    "dirichlet",
    "label skew: each class spread over the clients by shares drawn from "
    "Dir(data.alpha); re-drawn until every client has data.min_samples; "
    "data.balanced: NIID-Bench's cap of N / num_clients per client",
)
def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float = 0.5,
    min_samples: int = 1,
    balanced: bool = False,
) -> list[np.ndarray]:
    """Each class's samples go to the clients by shares drawn from Dir(alpha), the whole split
    drawn again until every client has ``min_samples``. ``balanced``: NIID-Bench's rule (Li et al.
    2022, ``partition_data``, ``noniid-labeldir``): the classes are dealt one after another in label
    order, and a client that already holds N / num_clients samples (N: the training samples) gets
    no share of the next classes, the others' shares scaled up to sum to 1. NIID-Bench asks for
    10 samples per client (``min_samples: 10``); it truncates the cumulative share bounds where
    fedsim rounds them (counts within one sample of share x class size either way)."""
    _check_positive("alpha", alpha)
    if not is_integer(min_samples) or not 0 <= min_samples * num_clients <= len(labels):
        raise _invalid(
            "min_samples",
            f"an integer from 0 to {len(labels) // num_clients} ({len(labels)} samples over {num_clients} clients)",
            min_samples,
        )
    if not isinstance(balanced, bool):
        raise _invalid("balanced", "true or false", balanced)
    class_sizes = np.unique(labels, return_counts=True)[1]
    for _ in range(MAX_DIRICHLET_DRAWS):
        if balanced:
            counts = _capped_counts(rng, alpha, class_sizes, num_clients, len(labels) / num_clients)
        else:
            shares = rng.dirichlet(np.full(num_clients, alpha), size=len(class_sizes))  # [classes, clients]
            counts = _split_counts(shares, class_sizes)
        if counts is not None and counts.sum(axis=0).min() >= min_samples:
            return _deal_by_class(labels, counts, rng)
    raise ConfigError(
        f"data.min_samples: no draw of {MAX_DIRICHLET_DRAWS} from Dir({alpha}) gave each of "
        f"{num_clients} clients {min_samples} samples; lower data.min_samples, raise data.alpha "
        f"or use fewer clients"
    )


def _capped_counts(rng, alpha, class_sizes, num_clients: int, cap: float) -> np.ndarray | None:
    """Counts ``[classes, clients]``, class by class: Dir(alpha) shares, zero for every client that
    already holds ``cap`` samples. None when the shares left are all zero (an alpha so small that
    the draws underflow): a draw to repeat."""
    held = np.zeros(num_clients, dtype=np.int64)
    counts = np.zeros((len(class_sizes), num_clients), dtype=np.int64)
    for c, size in enumerate(class_sizes):
        shares = rng.dirichlet(np.full(num_clients, alpha)) * (held < cap)
        if not shares.sum() > 0:
            return None
        counts[c] = _split_counts(shares / shares.sum(), size)
        held += counts[c]
    return counts


@PARTITIONS.register(
    "shards",
    "McMahan et al.'s pathological split: sorted by label, cut into "
    "num_clients x data.shards_per_client equal shards dealt at random",
)
def shards(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, shards_per_client: int = 2
) -> list[np.ndarray]:
    if not is_integer(shards_per_client) or shards_per_client < 1:
        raise _invalid("shards_per_client", "an integer >= 1", shards_per_client)
    num_shards = num_clients * shards_per_client
    if len(labels) % num_shards:
        raise ConfigError(
            f"data.shards_per_client: {len(labels)} samples cannot be cut into {num_clients} "
            f"clients x {shards_per_client} = {num_shards} equal shards; choose data.num_clients "
            f"x data.shards_per_client dividing {len(labels)}"
        )
    # A shard that straddles a class boundary gives its client a few samples of an extra class,
    # as in the original split; only class sizes that are multiples of the shard size avoid it.
    shard_owner = rng.permutation(np.repeat(np.arange(num_clients), shards_per_client))
    owner = np.empty(len(labels), dtype=np.int64)
    owner[_shuffled_by_class(labels, rng)] = np.repeat(shard_owner, len(labels) // num_shards)
    return _parts_from_owner(owner, num_clients)


@PARTITIONS.register(
    "label_k",
    "each client holds data.classes_per_client classes; each class is split equally among the clients holding it",
)
def label_k(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, classes_per_client: int = 2
) -> list[np.ndarray]:
    """Client i's first class is the (i mod C)-th of a random order of the C classes, so every
    class is held once there are at least C clients; its other k-1 classes are drawn uniformly
    from the rest. A class's samples are shuffled and split into equal parts (sizes differ by
    at most one) among the clients that hold it; with fewer than C clients, the samples of a
    class nobody drew are left out."""
    num_classes = len(np.unique(labels))
    k = classes_per_client
    if not is_integer(k) or not 1 <= k <= num_classes:
        raise _invalid("classes_per_client", f"an integer from 1 to the {num_classes} classes of the data", k)
    clients = np.arange(num_clients)
    first = rng.permutation(num_classes)[clients % num_classes]
    scores = rng.random((num_clients, num_classes))
    scores[clients, first] = -1.0  # sorts first, so it is always among the k taken
    held = np.zeros((num_clients, num_classes), dtype=bool)
    held[clients[:, None], np.argsort(scores, axis=1)[:, :k]] = True
    holders = held.sum(axis=0)
    class_sizes = np.unique(labels, return_counts=True)[1]
    rank = np.cumsum(held, axis=0) - 1  # the j-th holder of a class takes one of the remainder if j < it
    base, extra = class_sizes // np.maximum(holders, 1), class_sizes % np.maximum(holders, 1)
    counts = held * (base + (rank < extra))
    return _deal_by_class(labels, counts.T, rng)


@PARTITIONS.register(
    "quantity",
    "IID labels, skewed client sizes: data.quantity_skew lognormal (data.sigma) "
    "or dirichlet (data.alpha); every client gets at least one sample",
)
def quantity(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    quantity_skew: str = "lognormal",
    sigma: float = 1.0,
    alpha: float = 0.5,
) -> list[np.ndarray]:
    if quantity_skew == "lognormal":
        if not (is_number(sigma) and sigma >= 0):
            raise _invalid("sigma", "a finite number >= 0", sigma)
        weights = rng.lognormal(0.0, sigma, num_clients)
        if not math.isfinite(weights.sum()):  # exp(sigma z) past float64's largest for some draw z
            raise _invalid("sigma", f"small enough that the {num_clients} lognormal shares stay finite", sigma)
    elif quantity_skew == "dirichlet":
        _check_positive("alpha", alpha)
        weights = rng.dirichlet(np.full(num_clients, alpha))
    else:
        raise _invalid("quantity_skew", "lognormal or dirichlet", quantity_skew)
    # one sample each first, so no client is empty however small its share
    sizes = 1 + _split_counts(weights / weights.sum(), len(labels) - num_clients)
    return np.split(rng.permutation(len(labels)), np.cumsum(sizes)[:-1])


@PARTITIONS.register(
    "pachinko",
    "Reddi et al.'s CIFAR-100 split (TFF's): N // num_clients samples each, a coarse label by "
    "Dir(data.alpha) shares, then a fine label by Dir(data.beta) shares within it",
)
def pachinko(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    coarse_labels: np.ndarray,
    alpha: float = 0.1,
    beta: float = 10.0,
) -> list[np.ndarray]:
    """Pachinko allocation (Li and McCallum 2006, "Pachinko Allocation: DAG-Structured Mixture
    Models of Topic Correlations") down the tree of coarse and fine labels, as Reddi et al. 2021
    ("Adaptive Federated Optimization", appendix on CIFAR-100) split CIFAR-100 for TFF
    (``tff.simulation.datasets.cifar100``: alpha 0.1, beta 10, 500 clients of 100; data.alpha's
    default is dirichlet's 0.5). The clients are filled one after another, each with
    N // num_clients samples (the N mod num_clients left go to nobody). A client draws shares of
    the coarse labels left from Dir(alpha) and, for each, shares of its fine labels left from
    Dir(beta); each sample is a coarse label, a fine label within it, then one of that label's
    samples uniformly without replacement. A fine label that runs out leaves the tree and its
    siblings' shares are renormalized (a coarse label left without fine labels likewise), so later
    clients draw over what is left, as in Marfoq et al.'s reimplementation (2021, FedEM,
    ``pachinko_allocation_split``). A client's samples are drawn as a batch of fine labels by the
    product of the two shares (a coarse label, then a fine label within it), kept up to the draw
    that empties a label, the rest drawn again from the renormalized shares: the distribution of
    drawing them one at a time."""
    _check_positive("alpha", alpha)
    _check_positive("beta", beta)
    fine = np.unique(labels, return_inverse=True)[1].reshape(-1)
    parent = _parent_labels(labels, fine, np.asarray(coarse_labels))
    pool = _shuffled_by_class(fine, rng)  # each fine label's samples in random order, taken from the front
    left = np.bincount(fine)
    front = np.cumsum(left) - left
    owner = np.full(len(labels), -1, dtype=np.int64)
    one_group = np.zeros(parent.max() + 1, dtype=np.int64)
    for client in range(num_clients):
        coarse_share = _group_shares(0.0, one_group, np.bincount(parent, left > 0) > 0, alpha, rng)
        fine_share = _group_shares(0.0, parent, left > 0, beta, rng)
        wanted = len(labels) // num_clients
        while wanted:
            joint = coarse_share[parent] * fine_share
            drawn = rng.choice(len(left), wanted, p=joint / joint.sum())
            order = np.argsort(drawn, kind="stable")  # a draw's rank among the batch's draws of its label
            rank = np.empty_like(drawn)
            rank[order] = np.arange(wanted) - np.searchsorted(drawn[order], drawn[order])
            emptied = np.flatnonzero(rank + 1 == left[drawn])
            kept = emptied[0] + 1 if len(emptied) else wanted
            owner[pool[front[drawn[:kept]] + rank[:kept]]] = client
            taken = np.bincount(drawn[:kept], minlength=len(left))
            front, left, wanted = front + taken, left - taken, wanted - kept
            if len(emptied):
                fine_share = _group_shares(fine_share, parent, left > 0, beta, rng)
                coarse_share = _group_shares(coarse_share, one_group, np.bincount(parent, left > 0) > 0, alpha, rng)
    return _parts_from_owner(owner, num_clients)


def _parent_labels(labels: np.ndarray, fine: np.ndarray, coarse_labels: np.ndarray) -> np.ndarray:
    """The coarse label (as an index into the sorted distinct ones) of each fine label index."""
    if coarse_labels.shape != labels.shape:
        raise ConfigError(
            f"data.partition: pachinko needs one coarse label per sample; got {coarse_labels.shape} for {labels.shape}"
        )
    coarse = np.unique(coarse_labels, return_inverse=True)[1].reshape(-1)
    pairs = np.unique(np.stack([fine, coarse]), axis=1)  # the distinct (fine, coarse) pairs, by fine label
    if pairs.shape[1] != fine.max() + 1:
        twice = np.unique(labels)[pairs[0][np.flatnonzero(np.diff(pairs[0]) == 0)[0]]]
        raise ConfigError(
            f"data.partition: pachinko needs each label under one coarse label; label {twice} is under several"
        )
    return pairs[1]


def _group_shares(shares, groups: np.ndarray, available: np.ndarray, concentration: float, rng) -> np.ndarray:
    """``shares`` of the ``available`` entries, renormalized within each group (an entry's group:
    ``groups``). A group whose available shares sum to zero (none yet, or all underflowed) draws
    fresh ones from Dir(concentration), what renormalized Dirichlet shares are distributed as:
    gamma draws normalized, or numpy's Dirichlet where the gammas of a small concentration underflow."""
    shares = np.where(available, shares, 0.0)
    totals = np.bincount(groups, shares, minlength=groups.max() + 1)
    fresh = available & (totals[groups] == 0)
    if fresh.any():
        shares[fresh] = rng.standard_gamma(concentration, np.count_nonzero(fresh))
        totals = np.bincount(groups, shares, minlength=len(totals))
        for group in np.unique(groups[available & (totals[groups] == 0)]):
            members = np.flatnonzero(available & (groups == group))
            shares[members] = rng.dirichlet(np.full(len(members), concentration))
            totals[group] = 1.0
    return np.divide(shares, totals[groups], out=np.zeros(len(groups)), where=available)
