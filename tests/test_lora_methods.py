"""The federated LoRA methods with clients of different ranks, each against its paper's equations
written out here: lora.client_ranks, HetLoRA (truncation, self-pruning and its penalty,
zero-padding and sparsity-weighted aggregation) and FLoRA (fresh adapters, stacking, the merge
into the base, resumed and loaded back)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from support import installed
from test_text_data import play_root  # a generated play folder in the layout of the real texts

import fedsim
from fedsim.algorithms.base import Clients, Round
from fedsim.algorithms.flora import FLoRA
from fedsim.algorithms.hetlora import HetLoRA
from fedsim.core.errors import ConfigError
from fedsim.core.flat import FlatModel
from fedsim.experiment.validation import load_config, unused_settings
from fedsim.models.lora import LoraConfig, apply_lora, client_ranks

pytestmark = pytest.mark.skipif(not installed("peft"), reason="needs peft")

U32 = 2.0**-24  # float32 unit roundoff


class TwoLayers(nn.Module):
    lora_targets = ("first", "second")

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(5, 4, bias=False)
        self.second = nn.Linear(4, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def adapted(rank: int = 3, alpha: float = 6.0) -> FlatModel:
    torch.manual_seed(0)
    return FlatModel(apply_lora(TwoLayers(), LoraConfig(rank=rank, alpha=alpha), "two_layers"), "cpu")


def named(model: FlatModel, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """The adapters in ``weights`` ([n]) by layer: (A [r, in], B [out, r])."""
    out, offset, params = {}, 0, {}
    for name, p in model.module.named_parameters():
        if p.requires_grad:
            params[name] = weights[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
    for layer in ("first", "second"):
        out[layer] = (params[f"{layer}.lora_A.default.weight"], params[f"{layer}.lora_B.default.weight"])
    return out


def config_of(**changes) -> SimpleNamespace:
    lora = LoraConfig(rank=3, alpha=6.0, client_ranks=changes.pop("client_ranks", [1, 2, 3, 2]))
    defaults = dict(
        lora=lora,
        data=SimpleNamespace(num_clients=4),
        seed=5,
        aggregator=None,
        pre_aggregators=[],
        privacy=None,
        compression=SimpleNamespace(type="none"),
    )
    return SimpleNamespace(**{**defaults, "server_optimizer": "none", **changes})


def a_round(model: FlatModel, sent: torch.Tensor, samples: list[float]) -> Round:
    return Round(
        updates=sent - model.flat,
        weights=torch.tensor(samples),
        clients=torch.arange(len(sent)),
        reports={},
        aggregate=lambda updates, weights: (weights[:, None] * updates).sum(0) / weights.sum(),  # fedavg
        global_weights=model.flat.clone(),
        num_params=model.num_params,
        num_clients=4,
    )


def clients_of(ranks: list[int], seed: int) -> torch.Tensor:
    """Trained-looking adapters of clients of ``ranks`` on the 3-rank layout: random, zero beyond."""
    model, g = adapted(), torch.Generator().manual_seed(seed)
    sent = torch.randn(len(ranks), model.num_params, generator=g)
    for row, rank in zip(sent, ranks):
        for a, b in named(model, row).values():
            a[rank:] = 0
            b[:, rank:] = 0
    return sent


# ----------------------------------------------------------------------------- lora.client_ranks


def test_client_ranks_are_the_list_or_a_draw_from_the_runs_seed_alone():
    assert client_ranks(LoraConfig(rank=8), 3, 0).tolist() == [8, 8, 8]
    assert client_ranks(LoraConfig(rank=8, client_ranks=[2, 8, 4]), 3, 0).tolist() == [2, 8, 4]
    choice = LoraConfig(rank=8, client_ranks={"choice": [2, 4, 8]})
    drawn = client_ranks(choice, 3000, 7)
    assert torch.equal(drawn, client_ranks(choice, 3000, 7)) and not torch.equal(drawn, client_ranks(choice, 3000, 8))
    counts = torch.bincount(drawn, minlength=9)[[2, 4, 8]]
    assert counts.sum() == 3000 and (counts - 1000).abs().max() < 5 * math.sqrt(3000 * 1 / 3 * 2 / 3)  # 5 sigma
    uniform = client_ranks(LoraConfig(rank=8, client_ranks={"uniform": [3, 5]}), 3000, 7)
    assert set(uniform.tolist()) == {3, 4, 5}


@pytest.mark.parametrize(
    "spec, words",
    [
        ([1, 9], r"ranks must be whole numbers in \[1, lora.rank = 8\], got list \[1, 9\]"),
        ({"choice": []}, r"choice takes \[r1, r2, ...\]"),
        ({"uniform": [5, 3]}, r"low <= high"),
        ({"normal": [5, 3]}, r"must be null, a list of one rank per client"),
        ("4", r"must be null, a list of one rank per client"),
        ([2, 2.5], r"whole numbers"),
    ],
)
def test_bad_client_ranks_are_one_line_naming_the_key(spec, words):
    with pytest.raises(ConfigError, match=r"^lora.client_ranks: .*" + words):
        LoraConfig(rank=8, client_ranks=spec).check()


def test_a_list_of_client_ranks_holds_one_per_client():
    with pytest.raises(ConfigError, match=r"^lora.client_ranks: a list holds one rank per client: 3 \(data.num"):
        client_ranks(LoraConfig(rank=8, client_ranks=[2, 4]), 3, 0)


def test_client_ranks_with_an_algorithm_that_does_not_read_them_is_said():
    warnings = unused_settings(load_config({"lora": {"rank": 4, "client_ranks": [2, 4]}}))
    assert warnings == ["lora.client_ranks is [2, 4] but algorithm fedavg does not read it (use flora or hetlora)"]

    class OwnRanks(fedsim.Algorithm):  # an algorithm of one's own that declares it reads them
        reads = ("lora.client_ranks",)

    assert unused_settings(load_config({"algorithm": OwnRanks(), "lora": {"rank": 4, "client_ranks": [2, 4]}})) == []
    two_clients = {"num_clients": 2, "dataset": "synthetic"}
    hetlora = {
        "algorithm": "hetlora",
        "lora": {"rank": 4, "client_ranks": [2, 4]},
        "data": two_clients,
        "clients_per_round": 2,
    }
    assert unused_settings(load_config(hetlora)) == []


# ----------------------------------------------------------------------------- HetLoRA


def hetlora(**options) -> tuple[HetLoRA, FlatModel]:
    model, algorithm = adapted(), HetLoRA(**options)
    algorithm.setup(config_of())
    algorithm.bind(model.module)
    return algorithm, model


def test_hetlora_aggregates_zero_padded_adapters_weighted_by_the_norms_of_their_products():
    # Cho et al. 2024, Fig. 2 and Eq. (4): the clients' modules padded with zeros to r_max and
    # averaged with weights ||Delta W_k||_F / Z, Delta W_k = s B_k A_k over the whole model
    algorithm, model = hetlora()
    ranks, samples = [1, 3, 2], [10.0, 1.0, 5.0]
    sent = clients_of(ranks, seed=1)
    scaling = 6.0 / 3
    norms = torch.stack(
        [
            sum((scaling * b[:, :r] @ a[:r]).square().sum() for a, b in named(model, row).values()).sqrt()
            for row, r in zip(sent, ranks)
        ]
    )
    expected = sum(w * row for w, row in zip(norms / norms.sum(), sent))  # padded: zeros beyond r_k already
    delta = algorithm.server_update(a_round(model, sent, samples), {}, {})
    new = model.flat + delta
    torch.testing.assert_close(new, expected, rtol=0, atol=8 * U32 * float(sent.abs().max()))
    # a component beyond a client's rank averages the others' alone, weighted as they are
    a_first = [named(model, row)["first"][0] for row in sent]
    tail = named(model, new)["first"][0][2]  # the third row: client 1's only (ranks 1 and 2 end before)
    w = norms / norms.sum()
    torch.testing.assert_close(tail, w[1] * a_first[1][2], rtol=0, atol=4 * U32 * float(a_first[1].abs().max()))


def fake_fit(change):
    """A local training that records what it was given and changes the weights by ``change``."""
    given = {}

    def fit(start, epochs=None, trainable=None, term=None):
        given.update(start=start.clone(), trainable=trainable)
        weights = start.clone()
        change(weights)
        return SimpleNamespace(weights=weights)

    return fit, given


def test_a_hetlora_client_trains_the_global_adapters_truncated_to_its_rank():
    algorithm, model = hetlora()
    model.flat.copy_(torch.randn(model.num_params, generator=torch.Generator().manual_seed(2)))
    local = algorithm.start_client(
        Clients(torch.tensor([1]), 1, {}, {"lora_rank": torch.zeros(1, 1), "tail": -torch.ones(1, 1)})
    )
    assert local.rank == 2  # client 1's rank in [1, 2, 3, 2]
    fit, given = fake_fit(lambda w: None)
    algorithm.train_client(fit, model.flat, local)
    for (a, b), (ga, gb), (ma, mb) in zip(
        named(model, model.flat).values(),
        named(model, given["start"]).values(),
        named(model, given["trainable"]).values(),
    ):
        assert torch.equal(ga[:2], a[:2]) and torch.equal(gb[:, :2], b[:, :2])  # the first r_k components
        assert not ga[2:].any() and not gb[:, 2:].any()  # the rest cut off
        assert ma[:2].all() and not ma[2:].any() and mb[:, :2].all() and not mb[:, 2:].any()


def test_hetlora_prunes_a_tail_that_shrank_below_its_last_round_and_keeps_one_that_grew():
    algorithm, model = hetlora(gamma=0.5)
    model.flat.copy_(torch.randn(model.num_params, generator=torch.Generator().manual_seed(3)))

    def client(state_rank: float, tail: float, change):
        local = algorithm.start_client(
            Clients(
                torch.tensor([2]), 4, {}, {"lora_rank": torch.tensor([[state_rank]]), "tail": torch.tensor([[tail]])}
            )
        )
        fit, _ = fake_fit(change)
        trained = algorithm.train_client(fit, model.flat, local)
        return local, named(model, trained.weights)

    def shrink(w):  # the tail (component 1 of rank 3 with gamma 0.5: floor(1.5) = 1) scaled down
        for a, _ in named(model, w).values():
            a[1:3] *= 0.5

    before = algorithm.tail_norm(model.flat, 3)
    local, sent = client(0, -1, shrink)  # first round: compared with the tail it started from
    assert local.rank == 1  # pruned to floor(0.5 * 3)
    assert all(not a[1:].any() and not b[:, 1:].any() for a, b in sent.values())  # sent as zeros
    assert local.tail == 0  # rank 1: no tail left to measure
    report = algorithm.client_report(SimpleNamespace(weights=model.flat[None]), local)
    assert report["lora_rank"].tolist() == [[1.0]]
    local, sent = client(3, before / 8, shrink)  # its last round ended lower still: no pruning
    assert local.rank == 3 and local.tail == pytest.approx(before / 2, rel=1e-6)
    local, _ = client(3, -1, lambda w: None)  # unchanged: not below, kept
    assert local.rank == 3


def test_hetlora_penalty_gradient_is_that_of_lam_times_the_tail_norms_product():
    algorithm, model = hetlora(lam=0.3, gamma=0.4)  # rank 3: the tail is components 1 and 2
    weights = torch.randn(1, model.num_params, generator=torch.Generator().manual_seed(4), requires_grad=True)
    parts = named(model, weights[0])
    penalty = 0.3 * sum(a[1:3].norm() * b[:, 1:3].norm() for a, b in parts.values())
    (expected,) = torch.autograd.grad(penalty, weights)
    grad = torch.zeros(1, model.num_params)
    algorithm.adjust_gradient(grad, weights.detach(), model.flat, SimpleNamespace(rank=3))
    torch.testing.assert_close(grad, expected, rtol=4 * U32, atol=4 * U32 * float(expected.abs().max()))
    grad.zero_()
    algorithm.adjust_gradient(grad, weights.detach(), model.flat, SimpleNamespace(rank=1))  # rank 1: no tail
    assert not grad.any()


# ----------------------------------------------------------------------------- FLoRA


def flora(model: FlatModel | None = None) -> tuple[FLoRA, FlatModel]:
    model, algorithm = model or adapted(), FLoRA()
    algorithm.setup(config_of())
    algorithm.bind(model.module)
    return algorithm, model


def test_a_flora_client_starts_each_round_from_fresh_adapters_of_its_rank_as_peft_draws_them():
    algorithm, model = flora()
    model.flat.normal_()  # whatever the global adapters hold, a client does not start from them

    def start(client: int, rnd: int) -> dict:
        local = algorithm.start_client(Clients(torch.tensor([client]), rnd, {}, {}))
        fit, given = fake_fit(lambda w: None)
        algorithm.train_client(fit, model.flat, local)
        return named(model, given["start"])

    first = start(1, 1)  # rank 2
    for a, b in first.values():
        fan_in = a.shape[1]
        assert not b.any() and not a[2:].any() and a[:2].all()
        assert a.abs().max() <= 1 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
    assert all(torch.equal(x[0], y[0]) for x, y in zip(first.values(), start(1, 1).values()))
    assert not any(torch.equal(x[0], y[0]) for x, y in zip(first.values(), start(1, 2).values()))
    assert not torch.equal(first["first"][0][:1], start(3, 1)["first"][0][:1])


def test_flora_merges_the_stacked_adapters_into_the_base_exactly_and_keeps_b_at_zero():
    # Wang et al. 2024, Eq. (5)-(6): stacking A_k scaled by p_k and B_k gives the product
    # sum_k p_k B_k A_k, which the server adds to the base: W <- W + s sum_k p_k B_k A_k
    algorithm, model = flora()
    ranks, samples = [1, 3, 2], [10.0, 1.0, 5.0]
    sent = clients_of(ranks, seed=6)
    p = torch.tensor(samples) / sum(samples)
    base = {layer: getattr(model.module, layer).base_layer.weight.detach().clone() for layer in ("first", "second")}
    server = {name: torch.zeros(*shape) for name, shape in algorithm.server_state(model.num_params).items()}
    delta = algorithm.server_update(a_round(model, sent, samples), server, {})
    assert not delta.any()
    merged = []
    for layer in ("first", "second"):
        products = [2.0 * b @ a for a, b in (named(model, row)[layer] for row in sent)]  # s = 6 / 3
        expected = sum(pk * product for pk, product in zip(p, products))
        scale = float(max(product.abs().max() for product in products))
        weight = getattr(model.module, layer).base_layer.weight.detach()
        torch.testing.assert_close(
            weight - base[layer], expected, rtol=0, atol=8 * U32 * scale + 2 * U32 * float(base[layer].abs().max())
        )
        merged.append(weight.clone())
    assert torch.equal(server["base"], torch.cat([m.flatten() for m in merged])) and server["merges"].item() == 1
    # a model built again and given the state (a resumed run, fedsim.load_model) holds the same base, bit for bit
    again, _ = flora(adapted())
    rebuilt = adapted()
    again.bind(rebuilt.module)
    again.resume(server)
    for name, tensor in model.module.state_dict().items():
        assert torch.equal(rebuilt.module.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"lora": {"share_base": False}}, "lora.share_base: false gives each worker a base of its own"),
        ({"aggregator": "median"}, "aggregator: median is not applied"),
        ({"pre_aggregators": ["nnm"]}, "pre_aggregators: they are not applied"),
        ({"server_optimizer": "fedadam"}, "server_optimizer: fedadam is not applied"),
        ({"compression": {"type": "topk"}}, "compression.type: topk would part them"),
    ],
)
def test_flora_refuses_what_it_does_not_apply_in_one_line(tmp_path, changes, words):
    root, _ = play_root(tmp_path)
    cfg = lora_config(root, "flora", algorithm="flora", **changes)
    with pytest.raises(ConfigError, match=r"^config: algorithm: flora stacks the clients' adapters .*" + words):
        fedsim.run(cfg, out=tmp_path / "run", quiet=True)


@pytest.mark.parametrize("lora", [{"method": "ffa"}, {"rank": 0, "client_ranks": None}])
def test_hetlora_and_flora_need_adapters_whose_a_and_b_both_train(tmp_path, lora):
    root, _ = play_root(tmp_path)
    for algorithm in ("hetlora", "flora"):
        cfg = lora_config(root, algorithm, algorithm=algorithm, lora=lora)
        with pytest.raises(ConfigError, match=rf"^config: algorithm: {algorithm} trains LoRA adapters, A and B both"):
            fedsim.run(cfg, out=tmp_path / "run", quiet=True)


# ----------------------------------------------------------------------------- runs


def lora_config(root: Path, name: str, **changes) -> dict:
    """A run of a one-layer char_transformer on the play texts of ``root``: 4 clients of ranks
    1, 2, 4 and 3 on rank-4 adapters, 3 a round."""
    lora = {"rank": 4, "alpha": 8.0, "client_ranks": [1, 2, 4, 3], **changes.pop("lora", {})}
    return {
        "name": name,
        "seed": 3,
        "device": "cpu",
        "rounds": 3,
        "workers": 0,
        "clients_per_round": 3,
        "model": "char_transformer",
        "model_options": {"layers": 1, "heads": 2, "width": 16},
        "data": {
            "dataset": "shakespeare_text",
            "root": str(root),
            "sequence_length": 16,
            "num_clients": 4,
            "partition": "iid",
        },
        "local": {"batch_size": 8, "lr": 0.05, "optimizer": "adamw", "steps": 5},
        "lora": lora,
        **changes,
    }


def test_a_hetlora_run_reports_each_clients_rank_and_ranks_only_fall(tmp_path):
    root, _ = play_root(tmp_path)
    history = fedsim.run(lora_config(root, "hetlora", algorithm="hetlora"), out=tmp_path / "run", quiet=True)
    assert history.test_loss[-1] < history.test_loss[0]
    seen: dict[int, list[tuple[int, int]]] = {}
    for record in history.client_records:
        seen.setdefault(record["client"], []).append((record["trained_rank"], record["lora_rank"]))
    for client, ranks in seen.items():
        assert ranks[0][0] == [1, 2, 4, 3][client]  # its first round trains at its own rank
        for (trained, after), (trained_next, _) in zip(ranks, ranks[1:] + [(None, None)]):
            assert after in (trained, int(0.9 * trained) or trained)  # kept, or pruned to floor(gamma r)
            assert trained_next in (None, after)  # the next round trains at the rank the last left
    prunes = sum(after < trained for ranks in seen.values() for trained, after in ranks)
    assert history.summary["prunes"] == prunes > 0
    assert history.summary["aggregation"] == "sparsity-weighted zero-padding (HetLoRA)"
    table = fedsim.results_table([fedsim.load_run(history.run_dir)], keys=("aggregator",))
    assert table[0]["aggregator"] == "sparsity-weighted zero-padding (HetLoRA)"
    header = (history.run_dir / "clients.csv").read_text().splitlines()[0]
    assert header.endswith(",staleness,trained_rank,lora_rank")
    assert fedsim.load_run(history.run_dir).client_records == history.client_records


def test_a_flora_run_resumed_and_loaded_back_scores_what_it_scored(tmp_path):
    """The merges are the run's model: a run of 2 rounds resumed to 3 gives the 3-round run's
    test loss, and fedsim.load_model's model scores the run's last test loss."""
    from fedsim.data.datasets import load_dataset
    from fedsim.engine.loop import evaluate

    root, _ = play_root(tmp_path)
    whole = fedsim.run(lora_config(root, "whole", algorithm="flora"), out=tmp_path / "whole", quiet=True)
    assert [r["lora_rank"] for r in whole.client_records[:3]] == [
        [1, 2, 4, 3][r["client"]] for r in whole.client_records[:3]
    ]
    assert whole.test_loss[-1] < whole.test_loss[0]
    part = fedsim.run(lora_config(root, "part", algorithm="flora", rounds=2), out=tmp_path / "part", quiet=True)
    resumed = fedsim.resume(part.run_dir, rounds=3, quiet=True)
    assert resumed.test_loss == whole.test_loss  # the base copied back, not the merges' sum added once
    model = fedsim.load_model(whole.run_dir)
    data = load_dataset("shakespeare_text", root, sequence_length=16)
    with torch.no_grad():
        _, loss = evaluate(model, data.test_x, data.test_y, 2000)
    assert loss == pytest.approx(whole.test_loss[-1], rel=1e-6)


@pytest.mark.slow
def test_two_workers_give_the_numbers_of_one_process(tmp_path):
    """FLoRA's merges go into the base the server shares with the workers: a run with 2 workers
    scores what the run in one process scores (HetLoRA's ranks are client state, which every
    algorithm keeps the same way whatever the workers)."""
    root, _ = play_root(tmp_path)
    alone = fedsim.run(lora_config(root, "alone", algorithm="flora"), out=tmp_path / "alone", quiet=True)
    pooled = fedsim.run(lora_config(root, "pooled", algorithm="flora", workers=2), out=tmp_path / "pooled", quiet=True)
    assert pooled.test_loss == alone.test_loss
    assert [r["lora_rank"] for r in pooled.client_records] == [r["lora_rank"] for r in alone.client_records]
