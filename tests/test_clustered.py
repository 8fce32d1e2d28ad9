"""Clustered federations (algorithms/clustered.py, ifca.py, cfl.py): IFCA's choice of a cluster and
its per-cluster means, CFL's split criterion and bipartition, against references computed here
from the papers' equations; and both recovering planted clusters (data.rotations) better than
FedAvg's one model fits them."""

from __future__ import annotations

import copy
import itertools
import math
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import installed
from test_algorithms import COUNTS, U32, Extent, local_sgd, step_error, tiny_run, tiny_samples

import fedsim
from fedsim.algorithms import Round
from fedsim.algorithms.cfl import CFL, bipartition, cosine_similarities, splits
from fedsim.algorithms.ifca import IFCA
from fedsim.core.errors import ConfigError
from fedsim.core.flat import FlatModel
from fedsim.core.streams import CLUSTER_INIT, torch_seed
from fedsim.engine.loop import evaluate
from fedsim.experiment.federation import load_federation
from fedsim.experiment.validation import load_config
from fedsim.fl.aggregation import get as aggregation_rule
from fedsim.results.keys import flatten_config as flatten


def bound(algorithm, module, num_clients=6, seed=0, **config):
    """``algorithm`` set up for a run of ``num_clients`` clients and bound to ``module``."""
    algorithm.setup(load_config({"seed": seed, "clients_per_round": 2, "data": {"num_clients": num_clients}, **config}))
    algorithm.bind(module)
    return algorithm


def server_of(algorithm, model):
    server = {name: torch.zeros(shape) for name, shape in algorithm.server_state(model.num_params).items()}
    algorithm.start_server(server, model)
    return server


def a_round(updates, weights, clusters, global_weights, num_params, number=1, byzantine=0):
    k = len(clusters)
    return Round(
        updates=updates,
        weights=weights,
        clients=torch.arange(k),
        reports={"cluster": torch.tensor(clusters, dtype=torch.float32)[:, None]},
        aggregate=aggregation_rule("fedavg"),
        global_weights=global_weights,
        num_params=num_params,
        num_clients=k,
        byzantine=byzantine,
        number=number,
    )


def two_layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


# ----------------------------------------------------------------------------- IFCA


def ifca_reference_round(models, lr, batch_size):
    """One round of IFCA (Ghosh et al. 2020, Algorithm 2, model averaging) on the tiny problem
    (client of class c holds COUNTS[c] copies of sample c), in float64, from the cluster models
    ``models``: each client's choice argmin_j F_c(theta_j) (ties: the lowest j), its locally
    trained model, and theta_j + sum_c n_c (trained_c - theta_j) / sum_c n_c over j's clients (a
    cluster no client chose keeps its model); with the bound on the engine's float32 error."""
    samples, extent = tiny_samples().double(), Extent()
    chosen, trained, error = [], [], 0.0
    for cls, count in enumerate(COUNTS):
        losses = []
        for theta in models:
            weight, bias = theta[:12].view(3, 4), theta[12:]
            losses.append(float(F.cross_entropy(F.linear(samples[cls][None], weight, bias), torch.tensor([cls]))))
        j = min(range(len(models)), key=lambda j: (losses[j], j))
        others = [abs(losses[j] - loss) for i, loss in enumerate(losses) if i != j]
        assert min(others) > 1e-4  # a choice float32 cannot turn
        steps = math.ceil(count / batch_size)
        chosen.append(j)
        trained.append(local_sgd(models[j], cls, steps, lr, extent=extent))
        error += steps * step_error(extent, lr, batch_size)
    new = []
    for j, theta in enumerate(models):
        members = [c for c in range(len(COUNTS)) if chosen[c] == j]
        if not members:
            new.append(theta)
            continue
        n = torch.tensor([float(COUNTS[c]) for c in members], dtype=torch.float64)
        new.append(theta + sum(n[i] * (trained[c] - theta) for i, c in enumerate(members)) / n.sum())
    return chosen, new, error + 8 * U32 * max(float(t.abs().max()) for t in new)


def cluster_models(state):
    return [state["global"].double(), *state["algorithm"]["server"]["models"].double()]


def test_ifca_rounds_follow_the_papers_algorithm(tmp_path):
    """Round 2 of a run, from the cluster models round 1 left: each client trains the cluster of
    lowest loss on its data (clients.csv's cluster), and each cluster's model moves by the
    sample-weighted mean of its clients' updates."""
    options = {"algorithm_options": {"k": 3}}
    first = tiny_run(tmp_path / "one", "ifca", rounds=1, **options)
    second = tiny_run(tmp_path / "two", "ifca", rounds=2, **options)
    chosen, models, error = ifca_reference_round(cluster_models(first.state), lr=0.1, batch_size=2)
    got = cluster_models(second.state)
    for j in range(3):
        assert (got[j] - models[j]).abs().max() <= error, j
    rows = second.state["client_state"]["cluster"]
    assert [int(rows[second.holder[cls]][0]) for cls in range(3)] == chosen
    records = fedsim.load_run(tmp_path / "two").client_records
    assert {r["client"]: r["cluster"] for r in records if r["round"] == 2} == {
        second.holder[cls]: chosen[cls] for cls in range(3)
    }
    sizes = second.state["algorithm"]["server"]["sizes"]
    assert sizes.tolist() == [float(chosen.count(j)) for j in range(3)]


def test_ifca_ties_go_to_the_lowest_cluster_and_the_models_start_apart():
    module = two_layers()
    model = FlatModel(copy.deepcopy(module), "cpu")
    ifca = bound(IFCA(k=3), module, seed=5)
    server = server_of(ifca, model)
    local = types.SimpleNamespace(server=server)
    assert ifca.choose(types.SimpleNamespace(loss=lambda w: 1.0), model.flat, local) == 0
    losses = iter([2.0, 1.0, 1.0])
    assert ifca.choose(types.SimpleNamespace(loss=lambda w: next(losses)), model.flat, local) == 1
    # cluster j: the model with every layer drawn afresh from the seed's stream of cluster j
    for j in (1, 2):
        fresh = copy.deepcopy(module)
        torch.manual_seed(torch_seed(CLUSTER_INIT, 5, j))
        for layer in fresh.modules():
            if hasattr(layer, "reset_parameters"):
                layer.reset_parameters()
        assert torch.equal(server["models"][j - 1], torch.cat([p.detach().flatten() for p in fresh.parameters()]))
    assert not torch.equal(server["models"][0], model.flat) and not torch.equal(
        server["models"][0], server["models"][1]
    )
    assert server["sizes"].tolist() == [6.0, 0.0, 0.0]  # every client in cluster 0 until it chooses


@pytest.mark.parametrize("shared_layers", [0, 1])
def test_ifca_server_update_is_each_clusters_mean_and_the_shared_layers_everyones(shared_layers):
    module = two_layers()
    model = FlatModel(copy.deepcopy(module), "cpu")
    ifca = bound(IFCA(k=3, shared_layers=shared_layers), module)
    server = server_of(ifca, model)
    if shared_layers:  # the first layer (4 x 3 + 3 weights) is one for every cluster
        assert all(torch.equal(m[:15], model.flat[:15]) for m in server["models"])
    before = [model.flat.clone(), *server["models"].clone()]
    g = torch.Generator().manual_seed(0)
    updates, weights = torch.randn(5, len(model.flat), generator=g), torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    clusters = [0, 1, 1, 0, 1]  # nobody chose cluster 2
    rows = {"cluster": torch.zeros(5, 1)}
    delta = ifca.server_update(a_round(updates, weights, clusters, model.flat, model.num_params), server, rows)
    after = [before[0] + delta, *server["models"]]

    def mean(members):
        return sum(weights[i] * updates[i] for i in members) / sum(weights[i] for i in members)

    everyone = mean(range(5))
    for j, members in enumerate(([0, 3], [1, 2, 4], [])):
        want = before[j] + (mean(members) if members else 0.0)
        if shared_layers:
            want[:15] = before[j][:15] + everyone[:15]
        # a weighted mean of 5 rows, then a sum: a few roundings of the largest magnitude met
        magnitude = float(before[j].abs().max() + updates.abs().max())
        assert torch.allclose(after[j], want, rtol=0, atol=8 * U32 * magnitude), j
    if shared_layers:
        assert all(torch.equal(m[:15], after[0][:15]) for m in after[1:])  # still one shared layer, bit for bit
    assert rows["cluster"][:, 0].tolist() == clusters
    assert server["sizes"].tolist() == [6.0 - 3.0, 3.0, 0.0]  # two stayed in 0, three moved to 1
    assert ifca.round_figures(server) == {"clusters": 2}


def test_clustered_algorithms_refuse_what_they_cannot_combine_with_in_one_line():
    with pytest.raises(
        ConfigError, match="algorithm_options: shared_layers must leave the clusters a layer of their own"
    ):
        bound(IFCA(k=2, shared_layers=2), two_layers())
    with pytest.raises(ConfigError, match="algorithm_options: k must be an integer >= 1"):
        IFCA(k=0)
    with pytest.raises(ConfigError, match="server_optimizer: algorithm cfl moves each cluster's model"):
        load_config({"algorithm": "cfl", "server_optimizer": "fedadam"})
    with pytest.raises(ConfigError, match="aggregator: algorithm ifca .* use aggregator: fedavg"):
        load_config({"algorithm": "ifca", "aggregator": "median"})
    with pytest.raises(ConfigError, match="backend: vmap trains"):
        load_config({"algorithm": "ifca", "backend": "vmap"})


# ----------------------------------------------------------------------------- CFL


def test_cfl_splits_on_the_papers_criterion():
    """||mean update|| < eps1 and max ||update|| > eps2 (Sattler et al. 2020, eq. (30)-(31))."""
    opposed = torch.tensor([[3.0, 0.0], [-3.0, 0.2], [2.9, 0.1], [-2.9, -0.1]])  # mean (0, 0.05), norms ~3
    assert splits(opposed, eps1=0.4, eps2=1.6)
    assert not splits(opposed, eps1=0.04, eps2=1.6)  # not yet stationary for the cluster
    assert not splits(opposed, eps1=0.4, eps2=3.1)  # stationary for every client too
    assert not splits(opposed[:1], eps1=10.0, eps2=0.0)  # one client: nothing to split


def complete_linkage(similarity):
    """Agglomerative clustering with complete linkage on the distances -similarity, as sets, merged
    until two are left (ties: the first pair in order); the part without client 0 as a mask."""
    clusters = [[i] for i in range(len(similarity))]
    while len(clusters) > 2:
        pairs = itertools.combinations(range(len(clusters)), 2)
        distance = {(a, b): max(-float(similarity[i, j]) for i in clusters[a] for j in clusters[b]) for a, b in pairs}
        a, b = min(distance, key=lambda pair: (distance[pair], min(clusters[pair[0]]), min(clusters[pair[1]])))
        clusters[a] = clusters[a] + clusters.pop(b)
    second = next(c for c in clusters if 0 not in c)
    return torch.tensor([i in second for i in range(len(similarity))])


def test_cfl_bipartition_is_complete_linkage_on_the_cosine_similarities():
    g = torch.Generator().manual_seed(3)
    directions = torch.randn(2, 50, generator=g)
    for _ in range(5):
        # two planted groups of noisy directions, and unstructured updates
        groups = torch.randint(0, 2, (9,), generator=g)
        planted = directions[groups] + 0.8 * torch.randn(9, 50, generator=g)
        for updates in (planted, torch.randn(7, 50, generator=g)):
            similarity = cosine_similarities(updates)
            reference = torch.nn.functional.cosine_similarity(updates[:, None].double(), updates[None].double(), dim=2)
            assert torch.allclose(similarity, reference, rtol=0, atol=1e-12)
            second = bipartition(similarity)
            assert torch.equal(second if not second[0] else ~second, complete_linkage(similarity))
        # on planted groups it is the paper's optimal bipartition: the least largest similarity across
        parts = bipartition(cosine_similarities(planted))
        assert torch.equal(parts, groups.bool()) or torch.equal(parts, ~groups.bool())


@pytest.mark.slow  # the import of scikit-learn takes seconds
@pytest.mark.skipif(not installed("sklearn"), reason="scikit-learn is not installed")
def test_cfl_bipartition_is_fl_benchs():
    """FL-bench's src/server/cfl.py: AgglomerativeClustering(metric="precomputed", linkage="complete")
    fitted on -similarities."""
    from sklearn.cluster import AgglomerativeClustering

    g = torch.Generator().manual_seed(4)
    for m in (3, 6, 11):
        similarity = cosine_similarities(torch.randn(m, 20, generator=g))
        labels = AgglomerativeClustering(metric="precomputed", linkage="complete").fit(-similarity.numpy()).labels_
        second = bipartition(similarity)
        assert torch.equal(second, torch.from_numpy(labels != labels[0]))


def test_cfl_server_update_splits_a_cluster_and_moves_each_part_by_its_mean():
    module = two_layers()
    model = FlatModel(copy.deepcopy(module), "cpu")
    cfl = bound(CFL(eps1=0.5, eps2=1.0, min_cluster_size=2, start_round=3, max_clusters=3), module)
    server = server_of(cfl, model)
    P, n = len(model.flat), model.num_params
    direction = torch.zeros(P)
    direction[:n] = torch.linspace(-1, 1, n)
    # clients 0, 2, 4 pull one way, 1, 3 the other: mean small, each large
    updates = torch.stack([direction * s for s in (1.0, -1.5, 1.1, -1.4, 0.9)])
    weights = torch.tensor([2.0, 1.0, 1.0, 3.0, 1.0])
    assert splits(updates[:, :n], 0.5, 1.0)

    def update(rnd, clusters):
        rows = {"cluster": torch.tensor(clusters, dtype=torch.float32)[:, None]}
        g0 = model.flat.clone()
        models = server["models"].clone()
        delta = cfl.server_update(a_round(updates, weights, clusters, model.flat, n, number=rnd), server, rows)
        return rows["cluster"][:, 0].tolist(), g0, models, delta

    assigned, *_ = update(2, [0] * 5)  # before start_round: no split
    assert assigned == [0.0] * 5 and cfl.round_figures(server) == {"clusters": 1}
    assigned, g0, models, delta = update(3, [0] * 5)
    assert assigned == [0.0, 1.0, 0.0, 1.0, 0.0]  # the part of client 0 keeps cluster 0
    first, second = [0, 2, 4], [1, 3]

    def mean(members):
        return sum(weights[i] * updates[i] for i in members) / sum(weights[i] for i in members)

    tolerance = 8 * U32 * 2
    assert torch.allclose(delta, mean(first), rtol=0, atol=tolerance)
    assert torch.allclose(server["models"][0], g0 + mean(second), rtol=0, atol=tolerance)  # from cluster 0's model
    assert server["sizes"].tolist() == [6.0 - 2.0, 2.0, 0.0] and cfl.round_figures(server) == {"clusters": 2}
    # a part smaller than min_cluster_size, or a run at max_clusters, keeps the cluster whole
    for cfl in (CFL(eps1=0.5, eps2=1.0, min_cluster_size=3, start_round=3), CFL(eps1=0.5, eps2=1.0, max_clusters=1)):
        cfl = bound(cfl, module)
        server = server_of(cfl, model)
        assert update(3, [0] * 5)[0] == [0.0] * 5


def test_cfl_before_any_split_is_fedavg_number_for_number(tmp_path):
    fedavg = tiny_run(tmp_path / "fedavg", "fedavg", rounds=2)
    cfl = tiny_run(tmp_path / "cfl", "cfl", rounds=2)  # start_round 20: one cluster throughout
    assert torch.equal(fedavg.state["global"], cfl.state["global"])
    # and its traffic: the server, which assigns the clusters, is not sent a client's back
    traffic = ("bytes_down", "bytes_up")
    assert [[r[k] for k in traffic] for r in cfl.rows] == [[r[k] for k in traffic] for r in fedavg.rows]


# ----------------------------------------------------------------------------- planted clusters


def planted_run(tmp_path, algorithm, **options):
    """8 clients of generated images, those of odd ids turned by 180 degrees (data.rotations: 2, the
    rotated data of the CFL paper's code), all of them in each of 6 rounds."""
    cfg = {
        "name": algorithm,
        "seed": 0,
        "rounds": 6,
        "eval_every": 6,
        "workers": 0,
        "clients_per_round": 8,
        "algorithm": algorithm,
        "algorithm_options": options,
        "eval_per_client": True,
        "model": "mnist_cnn",
        "data": {"dataset": "synthetic", "num_clients": 8, "limit": 800, "test_partition": True, "rotations": 2},
        "local": {"batch_size": 20, "lr": 0.05},
    }
    return fedsim.run(cfg, out=tmp_path / algorithm, quiet=True)


def recovered(history) -> float:
    """The share of clients whose last cluster is that of their planted group, the clusters matched
    one to one with the groups (each cluster named by its clients' most common group)."""
    last = {r["client"]: r["cluster"] for r in history.client_records}
    group = {c: c % 2 for c in last}
    majority = {}
    for cluster in set(last.values()):
        members = [group[c] for c, k in last.items() if k == cluster]
        majority[cluster] = max(set(members), key=members.count)
    if len(set(majority.values())) < len(majority):  # two clusters for one group: not one to one
        return 0.0
    return sum(majority[last[c]] == group[c] for c in last) / len(last)


@pytest.mark.slow
def test_ifca_and_cfl_recover_planted_clusters_and_beat_fedavg(tmp_path):
    fedavg = planted_run(tmp_path, "fedavg").rows[-1]["client_accuracy_mean"]
    ifca = planted_run(tmp_path, "ifca", k=2)
    # CFL's thresholds for this setting's updates (||Δθ|| about 0.2 to 0.3 in its first rounds)
    cfl = planted_run(tmp_path, "cfl", eps1=0.12, eps2=0.2, start_round=2)
    for history in (ifca, cfl):
        assert recovered(history) >= 0.95
        assert history.rows[-1]["clusters"] == 2
        assert history.rows[-1]["client_accuracy_mean"] > fedavg + 0.1
        assert scored_with_cluster_models(history) == {r["client"]: r["accuracy"] for r in history.client_accuracy}


def scored_with_cluster_models(history) -> dict[int, float]:
    """Each client's accuracy on its own (turned) test split with its cluster's model, from the
    checkpoint: what eval_per_client must have scored."""
    state = torch.load(history.run_dir / "checkpoint.pt", weights_only=False)
    models = [state["global"], *state["algorithm"]["server"]["models"]]
    cfg = load_config(history.config)
    federation = load_federation(cfg)
    model = FlatModel(fedsim.load_model(history.run_dir), "cpu")
    scores = {}
    for client, split in enumerate(federation.test_parts()):
        model.flat.copy_(models[int(state["client_state"]["cluster"][client][0])])
        scores[client] = evaluate(model.module, federation.data.test_x[split], federation.data.test_y[split], 1000)[0]
    return scores


@pytest.mark.slow
@pytest.mark.parametrize(
    "algorithm, options",
    [("ifca", {"k": 3}), ("cfl", {"start_round": 2, "eps1": 10.0, "eps2": 0.0, "min_cluster_size": 1})],
)
def test_clustered_runs_are_the_same_bits_for_any_workers(tmp_path, algorithm, options):
    """Cluster choices, splits, cluster models and each client's score: workers 0 and 2 alike."""
    cfg = {
        "name": algorithm,
        "seed": 1,
        "rounds": 3,
        "clients_per_round": 3,
        "algorithm": algorithm,
        "algorithm_options": options,
        "eval_per_client": True,
        "data": {"dataset": "synthetic", "num_clients": 6, "limit": 300, "test_partition": True},
        "local": {"batch_size": 25, "lr": 0.05},
    }
    runs = [fedsim.run(cfg, out=tmp_path / f"w{w}", quiet=True, workers=w) for w in (0, 2)]
    states = [torch.load(tmp_path / f"w{w}" / "checkpoint.pt", weights_only=False) for w in (0, 2)]
    tensors = [dict(flatten({key: s[key] for key in ("global", "algorithm", "client_state")})) for s in states]
    assert tensors[0].keys() == tensors[1].keys()
    assert all(torch.equal(tensors[0][key], tensors[1][key]) for key in tensors[0]), algorithm
    assert [r["cluster"] for r in runs[0].client_records] == [r["cluster"] for r in runs[1].client_records]
    for column in ("test_accuracy", "client_accuracy_mean", "clusters", "train_loss"):
        assert getattr(runs[0], column) == getattr(runs[1], column), column
    assert algorithm == "ifca" or runs[0].clusters[-1] > 1  # cfl split
