import numpy as np
import pytest
import torch
from support import installed

from fedsim.core import streams
from fedsim.core.errors import ConfigError
from fedsim.data import PARTITIONS, load_dataset, options_for, partition
from fedsim.data.partition import Parts, local_test_split, natural_test_split, split
from fedsim.experiment.config import DataConfig


def shuffled_labels(class_sizes, seed=0):
    """Labels with the given number of samples per class, in random order."""
    labels = np.repeat(np.arange(len(class_sizes)), class_sizes)
    return np.random.default_rng(seed).permutation(labels)


UNEVEN = shuffled_labels([503, 611, 480, 597, 520, 455, 590, 622, 488, 534])  # 5,400 samples
EVEN = shuffled_labels([600] * 10)


def class_counts(parts, labels, num_classes=10):
    return np.stack([np.bincount(labels[p.numpy()], minlength=num_classes) for p in parts])


def assert_disjoint_and_covering(parts, n):
    every = torch.cat(parts)
    assert len(every) == n and torch.equal(every.sort().values, torch.arange(n))


COVERING = [
    ("iid", {}),
    ("contiguous", {}),
    ("dirichlet", {"alpha": 0.5}),
    ("dirichlet", {"alpha": 0.1, "min_samples": 20}),
    ("dirichlet", {"alpha": 0.5, "min_samples": 10, "balanced": True}),
    ("shards", {"shards_per_client": 2}),
    ("label_k", {"classes_per_client": 3}),
    ("quantity", {"quantity_skew": "lognormal", "sigma": 1.5}),
    ("quantity", {"quantity_skew": "dirichlet", "alpha": 0.3}),
    ("gamma_similarity", {"gamma": 0.33}),
]


@pytest.mark.parametrize("method, options", COVERING)
def test_every_partition_is_disjoint_covering_and_seeded(method, options):
    parts = partition(UNEVEN, method, 20, seed=5, **options)
    assert len(parts) == 20 and all(p.dtype == torch.int64 for p in parts)
    assert_disjoint_and_covering(parts, len(UNEVEN))
    again = partition(UNEVEN, method, 20, seed=5, **options)
    assert all(torch.equal(a, b) for a, b in zip(parts, again))
    if method != "contiguous":
        other = partition(UNEVEN, method, 20, seed=6, **options)
        assert not all(torch.equal(a, b) for a, b in zip(parts, other))


@pytest.mark.parametrize("method, options", COVERING)
def test_split_holds_each_method_parts_as_the_per_client_tensors_held_them(method, options):
    """A run's Parts (one flat tensor and offsets) against what partition returned before: one
    int64 tensor per client, converted from the method's arrays one by one."""
    fn = PARTITIONS.get(method)
    before = [
        torch.as_tensor(np.asarray(p), dtype=torch.int64) for p in fn(UNEVEN, 20, streams.partition_rng(5), **options)
    ]
    parts = split(UNEVEN, method, 20, seed=5, **options)
    assert isinstance(parts, Parts) and len(parts) == len(before) == 20
    assert all(a.dtype == torch.int64 and torch.equal(a, b) for a, b in zip(parts, before))
    assert parts.sizes().tolist() == [len(p) for p in before]
    assert (
        torch.equal(parts.indices, torch.cat(before))
        and parts[-1].data_ptr() == parts.indices[-len(before[-1]) :].data_ptr()
    )
    with pytest.raises(IndexError):
        parts[20]


def each_clients_samples(clients, kept):
    """The natural split as it was computed client by client: each kept client's sample indices,
    ascending."""
    return [torch.from_numpy(np.flatnonzero(clients == c)) for c in kept]


def test_natural_parts_are_each_kept_clients_samples_as_one_client_at_a_time_found_them():
    rng = np.random.default_rng(0)
    clients = rng.choice(np.arange(0, 3000, 3), size=20_000)  # ids with gaps, in no order, of unequal sizes
    ids = np.unique(clients)
    for num_clients in (len(ids), 57):
        parts = split(
            np.zeros(len(clients), np.int64), "natural", num_clients, 4, {"clients": torch.from_numpy(clients)}
        )
        draw = streams.partition_rng(4)
        kept = ids if num_clients == len(ids) else np.sort(draw.choice(ids, num_clients, replace=False))
        expected = each_clients_samples(clients, kept)
        assert len(parts) == num_clients and all(torch.equal(a, b) for a, b in zip(parts, expected))
        assert torch.equal(torch.from_numpy(clients)[parts.firsts()], torch.from_numpy(kept))
    # a test split: some kept clients hold no test sample, which gives them an empty part
    test_clients = rng.choice(ids[::2], size=500)
    tests = natural_test_split(torch.from_numpy(ids), torch.from_numpy(test_clients))
    assert all(torch.equal(a, b) for a, b in zip(tests, each_clients_samples(test_clients, ids)))
    assert (tests.sizes() == 0).sum() > 0 and tests.sizes().sum() == 500


def test_partition_accepts_a_label_tensor():
    parts = partition(torch.from_numpy(UNEVEN), "dirichlet", 10, seed=0)
    assert_disjoint_and_covering(parts, len(UNEVEN))


def test_dirichlet_with_tiny_alpha_puts_each_class_on_about_one_client():
    parts = partition(EVEN, "dirichlet", 10, seed=0, alpha=1e-3, min_samples=0)
    counts = class_counts(parts, EVEN)
    top_share = counts.max(axis=0) / 600
    assert np.mean(top_share >= 0.99) >= 0.8 and top_share.min() >= 0.5
    pairs = (counts >= 6).sum()  # (client, class) pairs with more than 1 % of the class
    assert pairs <= 12  # against 100 for an even spread


def test_dirichlet_with_huge_alpha_is_near_uniform():
    parts = partition(EVEN, "dirichlet", 10, seed=0, alpha=1e6)
    assert np.abs(class_counts(parts, EVEN) - 60).max() <= 2


def niid_bench_counts(labels, num_clients, seed, alpha, min_samples):
    """NIID-Bench's label skew (partition_data, noniid-labeldir) written out with loops, on the
    partition's stream and with fedsim's rounding of the cumulative bounds: class by class in label
    order, Dir(alpha) proportions over the clients, zero for a client that holds N / num_clients
    already, rescaled; the whole split again until every client has min_samples. [classes, clients]."""
    rng = streams.partition_rng(seed)
    sizes = np.unique(labels, return_counts=True)[1]
    while True:
        held, counts = [0] * num_clients, []
        for size in sizes:
            drawn = rng.dirichlet(np.full(num_clients, alpha))
            kept = [drawn[j] if held[j] < len(labels) / num_clients else 0.0 for j in range(num_clients)]
            bounds, cumulative = [], 0.0
            for j in range(num_clients):
                cumulative += kept[j] / sum(kept)
                bounds.append(round(cumulative * size) if j < num_clients - 1 else size)
            row = [b - a for a, b in zip([0] + bounds[:-1], bounds)]
            held = [h + r for h, r in zip(held, row)]
            counts.append(row)
        if min(held) >= min_samples:
            return np.array(counts)


@pytest.mark.parametrize("alpha, seed", [(0.5, 0), (0.5, 1), (0.1, 2), (1.0, 3)])
def test_balanced_dirichlet_is_niid_benchs_split(alpha, seed):
    parts = partition(UNEVEN, "dirichlet", 10, seed=seed, alpha=alpha, min_samples=10, balanced=True)
    counts = class_counts(parts, UNEVEN)  # [clients, classes]
    np.testing.assert_array_equal(counts, niid_bench_counts(UNEVEN, 10, seed, alpha, 10).T)
    # its rule, checked on the split itself: a client holding N / num_clients = 540 samples before a
    # class (in label order) gets none of it; every client has at least 10
    before = np.cumsum(counts, axis=1) - counts
    assert np.all(counts[before >= len(UNEVEN) / 10] == 0) and (before >= len(UNEVEN) / 10).any()
    assert counts.sum(axis=1).min() >= 10


def test_the_cap_narrows_client_sizes_and_classes_per_client():
    """Over 30 seeds at Dir(0.5), 10 clients: without the cap the spread of client sizes (std / mean)
    averages 0.39 and a client holds 9.3 classes; with it 0.26 and 8.4."""
    spread, classes = {}, {}
    for balanced in (False, True):
        counts = [
            class_counts(
                partition(UNEVEN, "dirichlet", 10, seed=s, alpha=0.5, min_samples=10, balanced=balanced), UNEVEN
            )
            for s in range(30)
        ]
        spread[balanced] = np.mean([c.sum(axis=1).std() / c.sum(axis=1).mean() for c in counts])
        classes[balanced] = np.mean([(c > 0).sum(axis=1).mean() for c in counts])
    assert spread[True] < spread[False] - 0.08 and classes[True] < classes[False] - 0.6


def test_dirichlet_min_samples_floor_holds_and_gives_up_in_one_line():
    parts = partition(UNEVEN, "dirichlet", 50, seed=1, alpha=0.2, min_samples=30)
    assert min(len(p) for p in parts) >= 30
    with pytest.raises(ConfigError, match=r"^data\.min_samples: no draw of 1000 from Dir") as info:
        partition(EVEN, "dirichlet", 20, seed=0, alpha=1e-3, min_samples=1)  # 10 classes, 20 clients
    assert "\n" not in str(info.value)


def test_shards_give_each_client_its_shards_of_sorted_labels():
    parts = partition(EVEN, "shards", 30, seed=2, shards_per_client=2)  # shards of 100 fit the classes
    assert {len(p) for p in parts} == {200}
    per_client = (class_counts(parts, EVEN) > 0).sum(axis=1)
    assert per_client.max() <= 2 and (class_counts(parts, EVEN) % 100 == 0).all()
    uneven = partition(UNEVEN, "shards", 20, seed=2, shards_per_client=3)  # shards of 90 straddle classes
    assert {len(p) for p in uneven} == {270}
    assert (class_counts(uneven, UNEVEN) > 0).sum(axis=1).max() <= 2 * 3


def test_label_k_gives_exactly_k_classes_split_equally():
    for k in (1, 2, 5):
        parts = partition(UNEVEN, "label_k", 25, seed=k, classes_per_client=k)
        counts = class_counts(parts, UNEVEN)
        assert ((counts > 0).sum(axis=1) == k).all()
        for column in counts.T:  # a class's holders get equal parts, within one sample
            held = column[column > 0]
            assert held.max() - held.min() <= 1
        assert_disjoint_and_covering(parts, len(UNEVEN))  # 25 clients >= 10 classes: all held


def test_label_k_with_fewer_clients_than_classes_leaves_unheld_classes_out():
    parts = partition(UNEVEN, "label_k", 3, seed=0, classes_per_client=2)
    counts = class_counts(parts, UNEVEN)
    assert ((counts > 0).sum(axis=1) == 2).all()
    every = torch.cat(parts)
    assert len(torch.unique(every)) == len(every) < len(UNEVEN)
    held = counts.sum(axis=0) > 0
    assert counts.sum() == np.bincount(UNEVEN)[held].sum()  # held classes are covered in full


def test_quantity_skews_sizes_but_keeps_labels_iid():
    parts = partition(EVEN, "quantity", 20, seed=0, quantity_skew="lognormal", sigma=1.5)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 1 and sizes.sum() == len(EVEN) and sizes.max() > 5 * sizes.min()
    biggest = class_counts(parts, EVEN)[sizes.argmax()]
    assert (biggest > 0).all() and biggest.max() < 2.5 * biggest.min()
    equal = partition(EVEN, "quantity", 20, seed=0, sigma=0.0)
    assert {len(p) for p in equal} == {300}
    tiny = partition(EVEN, "quantity", 200, seed=0, quantity_skew="dirichlet", alpha=0.01)
    tiny_sizes = np.array([len(p) for p in tiny])
    assert tiny_sizes.min() >= 1 and np.median(tiny_sizes) < 5 and tiny_sizes.sum() == len(EVEN)


@pytest.mark.parametrize(
    "method, options, key",
    [
        ("dirichlet", {"alpha": 0.0}, "alpha"),
        ("dirichlet", {"alpha": -1.0}, "alpha"),
        ("dirichlet", {"alpha": float("inf")}, "alpha"),
        ("dirichlet", {"min_samples": 601}, "min_samples"),
        ("dirichlet", {"min_samples": -1}, "min_samples"),
        ("dirichlet", {"balanced": "yes"}, "balanced"),
        ("shards", {"shards_per_client": 7}, "shards_per_client"),
        ("shards", {"shards_per_client": 0}, "shards_per_client"),
        ("label_k", {"classes_per_client": 11}, "classes_per_client"),
        ("label_k", {"classes_per_client": 0}, "classes_per_client"),
        ("quantity", {"quantity_skew": "zipf"}, "quantity_skew"),
        ("quantity", {"sigma": -0.5}, "sigma"),
        ("quantity", {"sigma": 1000.0}, "sigma"),  # exp(1000 z) overflows: no share left to split by
        ("quantity", {"quantity_skew": "dirichlet", "alpha": 0.0}, "alpha"),
        ("gamma_similarity", {"gamma": 1.5}, "gamma"),
        ("gamma_similarity", {"gamma": "half"}, "gamma"),
        # a bool is no number here, though Python counts True as 1
        ("dirichlet", {"alpha": True}, "alpha"),
        ("dirichlet", {"min_samples": True}, "min_samples"),
        ("shards", {"shards_per_client": True}, "shards_per_client"),
        ("label_k", {"classes_per_client": True}, "classes_per_client"),
        ("quantity", {"sigma": True}, "sigma"),
        ("gamma_similarity", {"gamma": True}, "gamma"),
    ],
)
def test_invalid_options_are_refused_in_one_line_naming_the_key(method, options, key):
    with pytest.raises(ConfigError) as info:
        partition(EVEN, method, 10, seed=0, **options)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"data.{key}: ")


@pytest.mark.parametrize("num_clients", [0, -1, 2.5, True, "10"])
def test_a_number_of_clients_that_is_no_positive_integer_is_refused_in_one_line(num_clients):
    with pytest.raises(ConfigError, match=r"^data\.num_clients: must be an integer >= 1, got [^\n]*$"):
        partition(EVEN, "iid", num_clients, seed=0)


def test_more_clients_than_samples_is_refused():
    with pytest.raises(ConfigError, match=r"^data\.num_clients: "):
        partition(np.arange(5), "dirichlet", 6, seed=0)


def test_options_for_reads_each_method_keys_from_the_data_config():
    data = DataConfig(
        alpha=0.2,
        min_samples=3,
        balanced=True,
        shards_per_client=4,
        classes_per_client=5,
        sigma=2.0,
        quantity_skew="dirichlet",
    )
    assert options_for("dirichlet", data) == {"alpha": 0.2, "min_samples": 3, "balanced": True}
    assert options_for("shards", data) == {"shards_per_client": 4}
    assert options_for("label_k", data) == {"classes_per_client": 5}
    assert options_for("quantity", data) == {"quantity_skew": "dirichlet", "sigma": 2.0, "alpha": 0.2}
    assert options_for("iid", data) == {}
    # in name order, so that partition.json is the same bytes for the same split
    assert list(options_for("dirichlet", data)) == ["alpha", "balanced", "min_samples"]
    assert {"iid", "contiguous", "dirichlet", "shards", "label_k", "quantity"} <= set(PARTITIONS.names())


def test_local_test_split_follows_each_client_label_mix():
    test_labels = shuffled_labels([100] * 10, seed=9)
    parts = partition(UNEVEN, "label_k", 10, seed=0, classes_per_client=2)
    tests = local_test_split(UNEVEN, parts, test_labels, seed=0)
    assert_disjoint_and_covering(tests, len(test_labels))  # every class is held by someone
    train, test = class_counts(parts, UNEVEN), class_counts(tests, test_labels)
    assert ((test > 0) <= (train > 0)).all()
    share = train / train.sum(axis=0)  # each client's share of each class, train vs test
    assert np.abs(test / 100 - share).max() <= 0.011
    again = local_test_split(UNEVEN, parts, torch.from_numpy(test_labels), seed=0)
    assert all(torch.equal(a, b) for a, b in zip(tests, again))


@pytest.mark.slow
def test_shards_on_real_mnist_match_the_pathological_split(mnist_root):
    labels = load_dataset("mnist", mnist_root).train_y
    parts = partition(labels, "shards", 100, seed=0, shards_per_client=2)
    counts = class_counts(parts, labels.numpy())
    assert {len(p) for p in parts} == {600}
    held = (counts > 0).sum(axis=1)
    assert held.max() <= 4 and np.mean(held <= 2) >= 0.85


def test_iid_is_a_seeded_equal_split_covering_everything():
    labels = np.arange(1003) % 10
    parts = partition(labels, "iid", 10, seed=1)
    assert sorted(torch.cat(parts).tolist()) == list(range(1003))
    assert {len(p) for p in parts} <= {100, 101}
    again = partition(labels, "iid", 10, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(parts, again))
    other = partition(labels, "iid", 10, seed=2)
    assert not all(torch.equal(a, b) for a, b in zip(parts, other))


def test_contiguous_gives_the_remainder_to_the_last_client():
    parts = partition(np.zeros(10), "contiguous", 3, seed=0)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]


@pytest.mark.parametrize("gamma", [0.0, 0.33, 0.66, 1.0])
def test_gamma_similarity_splits_a_gamma_share_at_random_and_the_rest_by_label(gamma):
    n, clients = len(EVEN), 10
    parts = partition(EVEN, "gamma_similarity", clients, seed=2, gamma=gamma)
    assert all(len(p) == n // clients for p in parts)  # 600 classes of 600 samples: every part even
    counts = class_counts(parts, EVEN)
    # the sorted part, (1 - gamma) n / clients samples, spans at most two neighbouring classes, so
    # the larger holds half of it at least; the random part, gamma n / clients, is spread over all ten
    assert counts.max(axis=1).min() >= (1 - gamma) * n / clients / 2
    if gamma == 0:  # each client one class, in label order
        assert (counts.argmax(axis=1) == np.arange(clients)).all() and ((counts > 0).sum(axis=1) == 1).all()
    if gamma == 1:  # iid: every client holds every class near its share of 60
        assert (counts > 30).all()


def test_gamma_similarity_holds_more_classes_as_gamma_grows():
    held = [
        (class_counts(partition(UNEVEN, "gamma_similarity", 20, seed=0, gamma=g), UNEVEN) > 0).sum(axis=1).mean()
        for g in (0.0, 0.1, 0.33, 1.0)
    ]
    assert held == sorted(held) and held[0] <= 2 and held[-1] == 10


@pytest.mark.skipif(not installed("byzfl"), reason="byzfl is not installed")
def test_gamma_zero_is_byzfls_extreme_split():
    from byzfl.fed_framework.data_distributor import DataDistributor

    byzfl = object.__new__(DataDistributor)  # its split alone, without the DataLoader it is built on
    byzfl.nb_honest = 10
    expected = byzfl.extreme_niid_idx(UNEVEN, np.arange(len(UNEVEN)))
    parts = partition(UNEVEN, "gamma_similarity", 10, seed=0, gamma=0.0)
    assert all(np.array_equal(np.sort(np.asarray(e)), p.numpy()) for e, p in zip(expected, parts))


# ----------------------------------------------------------------------------- planted clusters


def test_rotations_turn_each_clients_training_and_test_images_by_its_group():
    """data.rotations: 4 turns client c's training samples and test split by (c mod 4) quarter
    turns, the data unturned otherwise alike (the same split, labels and test splits)."""
    from fedsim.experiment.federation import load_federation
    from fedsim.experiment.validation import load_config

    def federation(**data):
        base = {"dataset": "synthetic", "num_clients": 8, "limit": 800, "partition": "dirichlet", "alpha": 1.0}
        return load_federation(load_config({"clients_per_round": 8, "data": {**base, **data}}))

    plain, turned = federation(), federation(rotations=4)
    assert torch.equal(plain.parts.indices, turned.parts.indices)
    assert torch.equal(plain.data.train_y, turned.data.train_y) and torch.equal(plain.data.test_y, turned.data.test_y)
    tests = plain.test_parts()
    for c in range(8):
        for x, y, index in (
            (turned.data.train_x, plain.data.train_x, plain.parts[c]),
            (turned.data.test_x, plain.data.test_x, tests[c]),
        ):
            assert torch.equal(x[index], torch.rot90(y[index], c % 4, dims=(2, 3)))
    assert not torch.equal(turned.data.train_x[plain.parts[1]], plain.data.train_x[plain.parts[1]])
    halves = federation(rotations=2)
    assert torch.equal(halves.data.train_x[plain.parts[3]], plain.data.train_x[plain.parts[3]].flip(2, 3))


def test_rotations_are_checked_in_one_line():
    from fedsim.experiment.validation import load_config

    with pytest.raises(
        ConfigError, match=r"data.rotations: must be 1, 2 or 4 \(turns of 360, 180 or 90 degrees\), got 3"
    ):
        load_config({"data": {"rotations": 3}})
    from fedsim.core.errors import DataError
    from fedsim.data import from_tensors
    from fedsim.experiment.federation import load_federation

    x, y = torch.randn(40, 4), torch.arange(40) % 2
    data = {"dataset": from_tensors(x, y, x, y), "num_clients": 4, "rotations": 2}
    cfg = load_config({"clients_per_round": 4, "data": data})
    with pytest.raises(DataError, match=r"data.rotations: turns images by 180 degrees, which needs images \[C, H, W\]"):
        load_federation(cfg)


def test_data_seed_keeps_one_split_under_every_run_seed():
    """data.seed draws the split (the partition and the clients' test splits) in place of the run's
    seed; unset, each seed draws its own, and data.seed = S is the split of a run of seed S."""
    from fedsim.experiment.federation import load_federation
    from fedsim.experiment.validation import load_config

    def federation(run_seed, data_seed=None):
        data = {"dataset": "synthetic", "num_clients": 8, "limit": 800, "partition": "dirichlet", "alpha": 0.5}
        data |= {"test_partition": True, "seed": data_seed}
        return load_federation(load_config({"seed": run_seed, "clients_per_round": 8, "data": data}))

    def same(a, b) -> bool:
        return torch.equal(a.parts.indices, b.parts.indices) and all(
            torch.equal(x, y) for x, y in zip(a.test_parts(), b.test_parts())
        )

    own = [federation(seed) for seed in (0, 1, 2)]
    fixed = [federation(seed, 0) for seed in (0, 1, 2)]
    assert not same(own[0], own[1]) and not same(own[1], own[2])
    assert all(same(f, own[0]) for f in fixed) and all(f.seed == 0 for f in fixed)
    assert same(federation(5, 2), own[2])
    with pytest.raises(ConfigError, match=r"^config: data.seed: must be >= 0, got -1$"):
        load_config({"data": {"seed": -1}})
