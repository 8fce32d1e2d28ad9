"""The parts of federated fine-tuning of language models, each against a reference written here:
AdamW against torch.optim.AdamW, local.steps in a run's records and on its simulated clock,
FlatModel's frozen base, LoRA adapters (FedIT and FFA-LoRA), initial_weights, a LoRA run's model
loaded back, and token-level scoring."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import Later, Recorder, installed
from test_text_data import play_root  # a generated play folder in the layout of the real texts

import fedsim
from fedsim.algorithms.fedprox import FedProx
from fedsim.algorithms.local import LocalTrainer
from fedsim.core.errors import ConfigError, FedsimError
from fedsim.core.flat import FlatModel
from fedsim.data.datasets import load_dataset
from fedsim.data.tensors import IGNORE_INDEX
from fedsim.engine.loop import evaluate
from fedsim.experiment.components import load_weights, run_model
from fedsim.experiment.config import Config, LocalConfig
from fedsim.experiment.validation import load_config
from fedsim.fl.client_eval import ClientEvaluation
from fedsim.models.language import char_transformer, hf_model
from fedsim.models.lora import LoraConfig, apply_lora, merged_adapters
from fedsim.results.rundir import read_clients

pytestmark = pytest.mark.skipif(not installed("transformers", "peft"), reason="needs transformers and peft")
transformers, peft = Later("transformers"), Later("peft")

U32 = 2.0**-24  # float32 unit roundoff


# ----------------------------------------------------------------------------- 1. AdamW


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(5, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def small_data(n: int = 20):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def adamw_local(epochs: int, weight_decay: float) -> LocalConfig:
    return LocalConfig(
        optimizer="adamw",
        lr=0.05,
        weight_decay=weight_decay,
        beta1=0.8,
        beta2=0.95,
        eps=1e-6,
        batch_size=20,
        epochs=epochs,
    )


def torch_adamw(model, x, y, local, seed, *, frozen=(), mu=0.0):
    """The reference: torch.optim.AdamW's own step (single-tensor, as on the CPU) on full batches
    drawn in the trainer's order (one randperm per epoch after manual_seed(seed)), so the gradients
    are the same numbers; FedProx's mu (w - w_global) added to the gradient before the step."""
    for name, p in model.named_parameters():
        p.requires_grad = name not in frozen
    params = [p for p in model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(
        params,
        lr=local.lr,
        betas=(local.beta1, local.beta2),
        eps=local.eps,
        weight_decay=local.weight_decay,
        foreach=False,
    )
    torch.manual_seed(seed)
    for _ in range(local.epochs):
        order = torch.randperm(len(y))
        opt.zero_grad()
        F.cross_entropy(model(x[order]), y[order]).backward()
        for p, p0 in zip(params, start):
            p.grad.add_(p.detach() - p0, alpha=mu)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def fedsim_adamw(model, x, y, local, seed, *, trainable=None, algorithm=None):
    flat = FlatModel(copy.deepcopy(model), "cpu")
    trainer = LocalTrainer(flat, x, y, local, num_classes=3, algorithm=algorithm)
    trained = trainer.train(torch.arange(len(y)), flat.flat.clone(), seed, trainable=trainable)
    assert int(trained.steps) == local.epochs  # one full batch an epoch
    return flat.flat.clone()


def test_adamw_without_decay_is_torchs_adamw_bit_for_bit():
    # same gradients (same batches, same kernels) and the same formula as torch's single-tensor
    # AdamW: every operation rounds the same way, so the weights are equal exactly
    torch.manual_seed(0)
    model, (x, y) = Small(), small_data()
    local = adamw_local(epochs=6, weight_decay=0.0)
    ours = fedsim_adamw(model, x, y, local, seed=4)
    reference = torch_adamw(copy.deepcopy(model), x, y, local, seed=4)
    assert torch.equal(ours, reference)
    assert (ours - torch.cat([p.detach().reshape(-1) for p in model.parameters()])).abs().min() > 0  # all moved


def test_adamw_with_decoupled_decay_matches_torchs_to_float32_rounding():
    # the one operation that differs: torch decays w * (1 - lr wd), fedsim w - (lr wd) w; each
    # rounds once, so the two weights differ by at most one unit roundoff of |w| per step (u |w|).
    # That difference reaches the next gradients but Adam's update m / sqrt(v) is of order lr per
    # step whatever the gradient's size, so a relative change of order u in a gradient moves it by
    # O(lr u): E steps leave at most about E (|w| + lr) u per weight; 8 x that is a safe bound
    torch.manual_seed(0)
    model, (x, y) = Small(), small_data()
    local = adamw_local(epochs=6, weight_decay=0.1)
    ours = fedsim_adamw(model, x, y, local, seed=4)
    reference = torch_adamw(copy.deepcopy(model), x, y, local, seed=4)
    bound = 8 * local.epochs * (reference.abs().max() + local.lr) * U32
    assert (ours - reference).abs().max() <= bound
    no_decay = torch_adamw(copy.deepcopy(model), x, y, adamw_local(6, 0.0), seed=4)
    assert (no_decay - reference).abs().max() > 1000 * bound  # the decay itself is far above the rounding


def test_adamw_keeps_frozen_coordinates_exactly_and_does_not_decay_them():
    torch.manual_seed(0)
    model, (x, y) = Small(), small_data()
    local = adamw_local(epochs=5, weight_decay=0.0)
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # the hidden layer's weight frozen as a whole: the reference leaves it out of its optimizer
    trainable = torch.ones_like(start)
    trainable[: model.hidden.weight.numel()] = 0
    ours = fedsim_adamw(model, x, y, local, seed=2, trainable=trainable)
    reference = torch_adamw(copy.deepcopy(model), x, y, local, seed=2, frozen=("hidden.weight",))
    assert torch.equal(ours, reference)
    # any coordinate mask, with decay: the frozen coordinates keep their values bit for bit
    mask = (torch.rand(start.shape, generator=torch.Generator().manual_seed(3)) < 0.5).float()
    decayed = fedsim_adamw(model, x, y, adamw_local(5, 0.3), seed=2, trainable=mask)
    assert torch.equal(decayed[mask == 0], start[mask == 0])
    assert (decayed[mask == 1] != start[mask == 1]).all()


def test_adamw_with_fedprox_adds_the_proximal_gradient_before_the_step():
    torch.manual_seed(0)
    model, (x, y) = Small(), small_data()
    local = adamw_local(epochs=5, weight_decay=0.0)
    ours = fedsim_adamw(model, x, y, local, seed=1, algorithm=FedProx(mu=0.5))
    reference = torch_adamw(copy.deepcopy(model), x, y, local, seed=1, mu=0.5)
    assert torch.equal(ours, reference)
    assert not torch.equal(ours, fedsim_adamw(model, x, y, local, seed=1))  # the term changed the result


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"local": {"optimizer": "adamw", "momentum": 0.9}}, "local.momentum: is SGD's"),
        ({"local": {"optimizer": "adamw", "beta1": 1.0}}, "local.beta1"),
        ({"local": {"optimizer": "adamw", "beta2": -0.1}}, "local.beta2"),
        ({"local": {"optimizer": "adamw", "eps": 0}}, "local.eps"),
        ({"local": {"optimizer": "adam"}}, "local.optimizer"),
    ],
)
def test_adamw_settings_refused_in_one_line(overrides, words):
    with pytest.raises(ConfigError) as error:
        load_config({"model": "mnist_cnn", "data": {"dataset": "synthetic"}, **overrides})
    assert words in str(error.value) and "\n" not in str(error.value)


# ----------------------------------------------------------------------------- 2. local.steps


def linear_classifier() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))


def capped_run(tmp_path, name, local, system):
    """One round of 6 clients of lognormal sizes (data.partition quantity) on synthetic images."""
    recorder = Recorder()
    cfg = {
        "name": name,
        "seed": 1,
        "device": "cpu",
        "rounds": 1,
        "workers": 0,
        "clients_per_round": 6,
        "model": linear_classifier,
        "data": {"dataset": "synthetic", "num_clients": 6, "limit": 240, "partition": "quantity", "sigma": 1.0},
        "local": {"batch_size": 10, "lr": 0.05, **local},
        "system": system,
    }
    fedsim.run(cfg, out=tmp_path / name, quiet=True, callbacks=[recorder])
    return recorder


def test_local_steps_caps_every_clients_work_and_the_simulated_clock_charges_the_capped_steps(tmp_path):
    # 2 epochs of batches of 10: a client of n samples has 2 ceil(n / 10) steps of work, capped at 5;
    # a step takes 0.5 simulated s at speed 1 (no speed spread), and the deadline is 3 s (6 steps)
    run = capped_run(tmp_path, "capped", {"epochs": 2, "steps": 5}, {"deadline": 3, "step_seconds": 0.5})
    full = {c["client"]: 2 * math.ceil(c["samples"] / 10) for c in run.clients}
    assert min(full.values()) < 5 and max(full.values()) > 6  # clients under the cap, and past the deadline uncapped
    expected = {client: min(work, 5) for client, work in full.items()}
    assert {c["client"]: c["steps"] for c in run.clients} == expected
    assert {c["client"]: c["steps"] for c in read_clients(tmp_path / "capped" / "clients.csv")} == expected
    # capped, nobody reaches the deadline: the round takes the slowest client's 5 steps x 0.5 s
    (row,) = run.rows
    assert row["stragglers"] == 0 and all(c["dropped"] == 0 for c in run.clients)
    assert row["simulated_seconds"] == max(expected.values()) * 0.5 == 2.5


def test_with_partial_stragglers_a_client_takes_the_smaller_of_its_cap_and_its_deadline_budget(tmp_path):
    # a deadline of 1.5 s at 0.5 s a step leaves every client 3 steps; the cap is 5
    system = {"deadline": 1.5, "step_seconds": 0.5, "stragglers": "partial"}
    run = capped_run(tmp_path, "partial", {"epochs": 2, "steps": 5}, system)
    full = {c["client"]: 2 * math.ceil(c["samples"] / 10) for c in run.clients}
    capped = {client: min(work, 5) for client, work in full.items()}
    assert min(capped.values()) <= 3 < max(capped.values())
    assert {c["client"]: c["steps"] for c in run.clients} == {client: min(n, 3) for client, n in capped.items()}
    (row,) = run.rows
    assert row["stragglers"] == sum(n > 3 for n in capped.values())
    assert row["simulated_seconds"] == 1.5  # the server waited for its stragglers until the deadline


# ----------------------------------------------------------------------------- 3. FlatModel's base


class Tied(nn.Module):
    """Token ids to scores through a tied embedding and head, a float and an int64 buffer, and one
    projection that LoRA adapts."""

    lora_targets = ("proj",)

    def __init__(self, vocab: int = 11, width: int = 6):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("shift", torch.randn(width))
        self.register_buffer("scale", torch.tensor(3, dtype=torch.int64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(self.emb(ids)) + self.shift)) * self.scale


def frozen_sizes(module: nn.Module) -> dict[str, int]:
    """numel per dtype of every frozen parameter and buffer, each tensor once (a tied weight is one)."""
    tensors = {id(p): p for _, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    tensors.update({id(b): b for _, b in module.named_buffers(remove_duplicate=False)})
    sizes: dict[str, int] = {}
    for t in tensors.values():
        sizes[str(t.dtype)] = sizes.get(str(t.dtype), 0) + t.numel()
    return sizes


def inside(tensor: torch.Tensor, base: torch.Tensor) -> bool:
    start = base.untyped_storage().data_ptr()
    return (
        start <= tensor.data_ptr()
        and tensor.data_ptr() + tensor.numel() * tensor.element_size() <= start + base.numel() * base.element_size()
    )


def adapted_tied(rank: int = 2) -> nn.Module:
    return apply_lora(Tied(), LoraConfig(rank=rank, alpha=4.0), "tied")


def test_the_base_holds_the_frozen_tensors_once_and_a_meta_built_twin_computes_the_same():
    torch.manual_seed(0)
    module = adapted_tied()
    sizes = frozen_sizes(module)
    # by hand: the tied table 11 x 6 once, proj 6 x 6 + 6, LayerNorm 6 + 6, the float buffer 6; the int64 one 1
    assert sizes == {"torch.float32": 66 + 42 + 12 + 6, "torch.int64": 1}
    server = FlatModel(module, "cpu")
    assert {dtype: t.numel() for dtype, t in server.base.items()} == sizes
    assert server.num_params == len(server.flat) == 2 * 6 + 6 * 2  # only the adapters: A 2 x 6, B 6 x 2
    for name, t in [*server.module.named_parameters(), *server.module.named_buffers()]:
        if not t.requires_grad:
            assert inside(t, server.base[str(t.dtype)]), f"{name} is not a view of the base"
    assert server.module.head.weight is server.module.emb.weight
    server.flat.copy_(torch.randn(len(server.flat)))  # B no longer zero: the adapters count
    with torch.device("meta"):
        twin = adapted_tied()
    worker = FlatModel(twin, "cpu", base=server.base)
    assert twin.head.weight is twin.emb.weight  # still tied, on the server's values
    worker.flat.copy_(server.flat)
    ids = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(worker.module(ids), server.module(ids))
    with pytest.raises(ValueError, match="shared base does not match"):
        FlatModel(apply_lora(Tied(vocab=12), LoraConfig(rank=2), "tied"), "cpu", base=server.base)


def test_a_bf16_base_with_fp32_parts_is_one_tensor_per_dtype():
    torch.manual_seed(0)
    module = Tied().to(torch.bfloat16)
    module.norm.float()  # a norm kept in float32, as mixed-precision models keep them
    module = apply_lora(module, LoraConfig(rank=2, alpha=4.0), "tied")
    sizes = frozen_sizes(module)
    assert sizes == {"torch.bfloat16": 66 + 42 + 6, "torch.float32": 12, "torch.int64": 1}
    flat = FlatModel(module, "cpu")
    assert {dtype: t.numel() for dtype, t in flat.base.items()} == sizes
    assert {dtype: t.dtype for dtype, t in flat.base.items()} == {
        "torch.bfloat16": torch.bfloat16,
        "torch.float32": torch.float32,
        "torch.int64": torch.int64,
    }
    assert len(flat.flat) == flat.num_params == 2 * 6 + 6 * 2
    assert flat.flat.dtype == torch.float32  # peft keeps the adapters of a bf16 layer in float32


def test_a_model_without_frozen_parameters_is_flat_as_before():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    module(torch.randn(8, 3))  # running statistics other than their start
    params = [p.detach().clone().reshape(-1) for p in module.parameters()]
    buffers = [module[1].running_mean.clone(), module[1].running_var.clone()]  # not num_batches_tracked (int64)
    flat = FlatModel(module, "cpu")
    assert flat.base == {}
    assert flat.num_params == sum(len(p) for p in params) == 3 * 4 + 4 + 4 + 4 + 4 * 2 + 2
    assert torch.equal(flat.flat, torch.cat(params + buffers))
    assert module[0].weight.data_ptr() == flat.flat.data_ptr()


# ----------------------------------------------------------------------------- 4. LoRA


def adapted_layers(module: nn.Module, suffixes) -> list[nn.Linear]:
    return [m for name, m in module.named_modules() if isinstance(m, nn.Linear) and name.endswith(tuple(suffixes))]


def lora_count(layers: list[nn.Linear], rank: int, method: str) -> int:
    """Hu et al. 2022: A is r x in, B is out x r; FFA-LoRA trains B alone."""
    return sum(rank * layer.out_features + (rank * layer.in_features if method == "fedit" else 0) for layer in layers)


def trainable_of(module: nn.Module) -> dict[str, int]:
    return {name: p.numel() for name, p in module.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("method", ["fedit", "ffa"])
def test_lora_on_char_transformer_trains_the_adapters_of_its_attention(method):
    torch.manual_seed(0)
    model = char_transformer((16,), 256, layers=2, heads=2, width=32).eval()
    layers = [(layer.in_features, layer.out_features) for layer in adapted_layers(model, model.lora_targets)]
    assert layers == [(32, 96), (32, 96)]
    ids = torch.randint(0, 256, (2, 16))
    before = model(ids)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0, method=method), "char_transformer")
    trained = trainable_of(model)
    expected = sum(4 * out + (4 * fan_in if method == "fedit" else 0) for fan_in, out in layers)
    assert sum(trained.values()) == expected == (2 * 4 * (32 + 96) if method == "fedit" else 2 * 4 * 96)
    kinds = {"lora_A", "lora_B"} if method == "fedit" else {"lora_B"}
    assert {name.split(".")[-3] for name in trained} == kinds
    assert all(".attn.c_attn." in name for name in trained) and len(trained) == 2 * len(kinds)
    assert torch.equal(model(ids), before)  # B starts at zero: the adapters add nothing yet


def llama_folder(tmp_path: Path) -> Path:
    """A tiny Llama's config.json (grouped-query attention: v_proj narrower than q_proj)."""
    folder = tmp_path / "llama"
    transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("method", ["fedit", "ffa"])
def test_lora_on_a_tiny_llama_adapts_pefts_default_layers(tmp_path, method):
    torch.manual_seed(0)
    model = hf_model(f"hf:{llama_folder(tmp_path)}", (8,), 256).eval()
    layers = adapted_layers(model, ("q_proj", "v_proj"))  # peft's default targets for Llama
    assert [(m.in_features, m.out_features) for m in layers] == [(32, 32), (32, 16)] * 2
    expected = lora_count(layers, 4, method)
    ids = torch.randint(0, 256, (2, 8))
    before = model(ids)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0, method=method), "llama")
    assert sum(trainable_of(model).values()) == expected == (2 * 4 * (64 + 48) if method == "fedit" else 2 * 4 * 48)
    assert torch.equal(model(ids), before)


def test_lora_on_layers_the_model_lacks_is_one_line():
    model = char_transformer((16,), 256, layers=1, heads=2, width=16)
    with pytest.raises(ConfigError) as error:
        apply_lora(model, LoraConfig(rank=2, target_modules=["no_such_layer"]), "char_transformer")
    message = str(error.value)
    assert message.startswith("lora.target_modules: ") and "char_transformer" in message and "\n" not in message
    untargeted = nn.Sequential(nn.Linear(3, 3))  # no lora_targets of its own, not a transformers model
    with pytest.raises(ConfigError, match=r"^lora.target_modules: name the layers of seq to adapt"):
        apply_lora(untargeted, LoraConfig(rank=2), "seq")


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"rank": -1}, "rank"),
        ({"alpha": 0.0}, "alpha"),
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
        ({"method": "fedavg"}, "method"),
        ({"target_modules": 5}, "target_modules"),
        ({"target_modules": []}, "target_modules"),
        ({"target_modules": " "}, "target_modules"),
        ({"target_modules": ["q_proj", 3]}, "target_modules"),
    ],
)
def test_lora_section_refuses_each_bad_value_in_one_line(changes, key):
    with pytest.raises(ConfigError) as error:
        LoraConfig(**{"rank": 4, **changes}).check()
    assert str(error.value).startswith(f"lora.{key}: ") and "\n" not in str(error.value)
    LoraConfig(rank=4, target_modules=["q_proj", "v_proj"], method="ffa", dropout=0.1).check()


class OneLayer(nn.Module):
    lora_targets = ("proj",)

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def integers(*shape: int, seed: int) -> torch.Tensor:
    """Small whole numbers: their products and the halves of their sums are exact in float32."""
    return torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(seed)).float()


def averaged_adapters(method: str):
    """Two clients' adapters averaged as FedAvg averages any flat state, through peft's modules;
    returns (the mean of the clients' B_i A_i, the averaged model's B A, the mean of the clients'
    outputs, the averaged model's output). alpha = rank: the scaling is 1."""
    module = apply_lora(OneLayer(), LoraConfig(rank=2, alpha=2.0, method=method), "one_layer")
    layer = module.proj
    with torch.no_grad():
        layer.base_layer.weight.copy_(integers(2, 3, seed=0))
        layer.lora_A["default"].weight.copy_(integers(2, 3, seed=1))  # what every client starts from
    server = FlatModel(module, "cpu")
    x = integers(4, 3, seed=2)
    clients = []
    for client in range(2):  # each client's trained adapters: B_i, and for FedIT its own A_i
        with torch.no_grad():
            layer.lora_B["default"].weight.copy_(integers(2, 2, seed=10 + client))
            if method == "fedit":
                layer.lora_A["default"].weight.copy_(integers(2, 3, seed=20 + client))
        clients.append((server.flat.clone(), layer.get_delta_weight("default"), module(x).detach()))
    server.flat.copy_((clients[0][0] + clients[1][0]) / 2)
    mean_delta = (clients[0][1] + clients[1][1]) / 2
    mean_output = (clients[0][2] + clients[1][2]) / 2
    return mean_delta, layer.get_delta_weight("default"), mean_output, module(x).detach()


def test_ffa_averages_the_adapters_product_exactly_and_fedit_does_not():
    # FFA-LoRA (Sun et al. 2024): A frozen and shared, so mean(B_i A) = (mean B_i) A and the
    # averaged model computes the mean of the clients' functions; FedIT's mean of A and B apart
    # gives (mean B_i)(mean A_i), another matrix in general. Whole numbers make both sides exact.
    mean_delta, averaged_delta, mean_output, averaged_output = averaged_adapters("ffa")
    assert torch.equal(averaged_delta, mean_delta) and torch.equal(averaged_output, mean_output)
    assert mean_delta.abs().sum() > 0
    mean_delta, averaged_delta, mean_output, averaged_output = averaged_adapters("fedit")
    assert (averaged_delta - mean_delta).abs().max() >= 0.25  # products of halves differ by quarters at least
    assert not torch.equal(averaged_output, mean_output)


# ----------------------------------------------------------------------------- 5. initial_weights


def full_run(tmp_path: Path) -> Path:
    cfg = {
        "name": "full",
        "seed": 2,
        "device": "cpu",
        "rounds": 1,
        "workers": 0,
        "clients_per_round": 2,
        "model": linear_classifier,
        "data": {"dataset": "synthetic", "num_clients": 2, "limit": 40},
        "local": {"batch_size": 10, "lr": 0.1},
    }
    return fedsim.run(cfg, out=tmp_path / "full", quiet=True).run_dir


def test_initial_weights_load_a_runs_global_model_exactly(tmp_path):
    run_dir = full_run(tmp_path)
    saved = torch.load(Path(run_dir) / "checkpoint.pt", weights_only=True)["global"]
    reference = linear_classifier()
    torch.nn.utils.vector_to_parameters(saved, reference.parameters())  # no buffers: the parameters in order
    torch.manual_seed(5)
    fresh = linear_classifier()
    assert not torch.equal(fresh[1].weight, reference[1].weight)
    load_weights(fresh, str(run_dir), "linear_classifier")
    x = torch.randn(4, 1, 28, 28)
    assert torch.equal(fresh(x), reference(x))
    cfg = Config(model=linear_classifier, initial_weights=str(Path(run_dir) / "checkpoint.pt"))
    assert torch.equal(run_model(cfg, (1, 28, 28), 10)(x), reference(x))


def test_bad_initial_weights_are_one_line_naming_the_key(tmp_path):
    run_dir = full_run(tmp_path)
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    cases = [
        (tmp_path / "nowhere", "does not exist"),
        (tmp_path / "notes.txt", "notes.txt: corrupt or not a fedsim checkpoint"),
        (run_dir, "it is another model's checkpoint"),  # a real checkpoint, of a model of another size
    ]
    for source, words in cases:
        with pytest.raises(ConfigError) as error:
            load_weights(nn.Sequential(nn.Flatten(), nn.Linear(784, 5)), str(source), "other")
        message = str(error.value)
        assert message.startswith("initial_weights: ") and words in message and "\n" not in message
    cfg = {"name": "missing", "device": "cpu", "rounds": 1, "workers": 0, "clients_per_round": 2}
    cfg |= {"model": linear_classifier, "data": {"dataset": "synthetic", "num_clients": 2, "limit": 40}}
    with pytest.raises(ConfigError, match="initial_weights: .* does not exist") as error:
        fedsim.run({**cfg, "initial_weights": str(tmp_path / "nowhere")}, out=tmp_path / "missing", quiet=True)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "missing").exists()  # nothing half-written


# ----------------------------------------------------------------------------- 6. a LoRA run's model back


def lora_run(tmp_path: Path, root: Path, name: str, **changes) -> fedsim.History:
    """A LoRA run of a one-layer char_transformer on the play texts of ``root``: 2 rounds of both
    roles (``partition: natural`` unless ``data`` says otherwise), with ``changes``."""
    cfg = {
        "name": name,
        "seed": 3,
        "device": "cpu",
        "rounds": 2,
        "workers": 0,
        "clients_per_round": 2,
        "model": "char_transformer",
        "model_options": {"layers": 1, "heads": 2, "width": 16},
        "data": {"dataset": "shakespeare_text", "root": str(root), "sequence_length": 16, "num_clients": 2},
        "local": {"batch_size": 8, "lr": 0.01, "optimizer": "adamw", "steps": 3},
        "lora": {"rank": 2, "alpha": 4.0},
        **changes,
    }
    cfg["data"].setdefault("partition", "natural")
    return fedsim.run(cfg, out=tmp_path / name, quiet=True)


def test_load_model_of_a_lora_run_scores_the_runs_final_test_loss(tmp_path):
    root, _ = play_root(tmp_path)
    history = lora_run(tmp_path, root, "lora")
    model = fedsim.load_model(history.run_dir)
    assert sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) == 2 * 16 + 48 * 2  # A 2 x 16, B 48 x 2
    data = load_dataset("shakespeare_text", root, sequence_length=16)
    with torch.no_grad():
        accuracy, loss = evaluate(model, data.test_x, data.test_y, 2000)
    assert loss == history.test_loss[-1] and accuracy == history.test_accuracy[-1]
    torch.manual_seed(0)  # another seed's base: the run's adapters alone do not give its loss
    other = run_model(
        Config(
            model="char_transformer",
            model_options={"layers": 1, "heads": 2, "width": 16},
            lora=LoraConfig(rank=2, alpha=4.0),
        ),
        (16,),
        256,
    )
    FlatModel(other, "cpu").flat.copy_(torch.load(Path(history.run_dir) / "checkpoint.pt", weights_only=True)["global"])
    with torch.no_grad():
        assert evaluate(other, data.test_x, data.test_y, 2000)[1] != loss


def test_load_model_of_a_lora_run_from_initial_weights_scores_its_final_test_loss(tmp_path):
    root, _ = play_root(tmp_path)
    base = lora_run(tmp_path, root, "base", lora={"rank": 0}, rounds=1)  # every weight trained: a new base
    history = lora_run(tmp_path, root, "tuned", initial_weights=str(base.run_dir))
    model = fedsim.load_model(history.run_dir)
    data = load_dataset("shakespeare_text", root, sequence_length=16)
    with torch.no_grad():
        assert evaluate(model, data.test_x, data.test_y, 2000)[1] == history.test_loss[-1]


@pytest.mark.slow
def test_a_lora_run_is_not_resumed_or_loaded_on_another_base_than_it_started_from(tmp_path):
    root, _ = play_root(tmp_path)
    base = lora_run(tmp_path, root, "base", lora={"rank": 0}, rounds=1)
    tuned = lora_run(tmp_path, root, "tuned", initial_weights=str(base.run_dir))
    assert fedsim.resume(tuned.run_dir, rounds=3, quiet=True).round[-1] == 3  # the same base: resumed
    with pytest.raises(ConfigError, match=r"initial_weights: .* holds [\d,]+ weights, the LoRA adapters of a run"):
        lora_run(tmp_path, root, "again", initial_weights=str(tuned.run_dir))  # not a whole model
    saved = Path(base.run_dir) / "checkpoint.pt"
    state = torch.load(saved, weights_only=True)
    state["global"] += 0.01  # the base run continued, say, or another run in its place
    torch.save(state, saved)
    words = rf"the run trained on another frozen base than initial_weights {base.run_dir} gives now"
    with pytest.raises(FedsimError, match=words):
        fedsim.resume(tuned.run_dir, rounds=4, quiet=True)
    with pytest.raises(FedsimError, match=words):
        fedsim.load_model(tuned.run_dir)


# ----------------------------------------------------------------------------- 7. token-level scoring


class Fixed(nn.Module):
    """Hands back fixed scores: sample i's are ``table[i]``, the sample's index its first input."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = nn.Parameter(table, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[x[:, 0]]


def direct_scores(table: torch.Tensor, targets: torch.Tensor) -> tuple[int, int, float]:
    """(right, scored, summed loss in float64) over the targets that are not IGNORE_INDEX, one by one."""
    right = scored = 0
    total = 0.0
    rows = table.double().reshape(-1, table.shape[-1]).tolist()
    for row, target in zip(rows, targets.reshape(-1).tolist()):
        if target == IGNORE_INDEX:
            continue
        scored += 1
        right += int(max(range(len(row)), key=row.__getitem__) == target)
        total += math.log(sum(math.exp(v) for v in row)) - row[target]
    return right, scored, total


def token_case(n: int = 7, steps: int = 5, vocab: int = 6):
    g = torch.Generator().manual_seed(4)
    table = torch.randn(n, steps, vocab, generator=g) * 3
    targets = torch.randint(0, vocab, (n, steps), generator=g)
    targets[torch.rand(n, steps, generator=g) < 0.3] = IGNORE_INDEX
    targets[2] = IGNORE_INDEX  # a sample with nothing scored
    targets[3, :] = table[3].argmax(dim=-1)  # one all right
    ids = torch.arange(n)[:, None].expand(n, steps).contiguous()
    return Fixed(table), ids, targets


def test_evaluate_scores_the_tokens_that_are_not_ignored():
    model, ids, targets = token_case()
    right, scored, total = direct_scores(model.table.detach(), targets)
    assert 0 < right < scored < targets.numel()
    for batch_size in (3, 100):  # batches that split the set and one that holds it
        accuracy, loss = evaluate(model, ids, targets, batch_size)
        assert accuracy == right / scored
        # float32 log-softmax of scores within about +-10: an error of a few u x 10 per token
        assert loss == pytest.approx(total / scored, rel=0, abs=64 * 10 * U32)


def test_evaluate_of_class_labels_is_a_direct_argmax_and_cross_entropy():
    g = torch.Generator().manual_seed(5)
    table = torch.randn(9, 4, generator=g) * 3
    labels = torch.randint(0, 4, (9,), generator=g)
    right, scored, total = direct_scores(table, labels)
    accuracy, loss = evaluate(Fixed(table), torch.arange(9)[:, None], labels, 4)
    assert scored == 9 and accuracy == right / 9 and loss == pytest.approx(total / 9, rel=0, abs=64 * 10 * U32)


def test_per_client_scores_count_each_clients_scored_tokens():
    model, ids, targets = token_case()
    parts = [torch.tensor([0, 4]), torch.tensor([1, 2, 6]), torch.tensor([3]), torch.tensor([5])]
    evaluation = ClientEvaluation(parts, torch.device("cpu"))
    columns = evaluation.score(model, ids, targets, batch_size=2, rnd=1)
    accuracies = []
    for part in parts:
        right, scored, _ = direct_scores(model.table.detach()[part], targets[part])
        accuracies.append(right / scored)
    assert [row["accuracy"] for row in evaluation.last] == pytest.approx(accuracies, rel=1e-15)
    assert accuracies[2] == 1.0
    mean = sum(accuracies) / 4
    assert columns["client_accuracy_mean"] == pytest.approx(mean, rel=1e-12)
    std = math.sqrt(sum((a - mean) ** 2 for a in accuracies) / 4)
    assert columns["client_accuracy_std"] == pytest.approx(std, rel=1e-12)
    # classification: a client's accuracy is its right labels over its samples
    labels = targets[:, 0].clamp_min(0)
    columns = evaluation.score(Fixed(model.table.detach()[:, 0]), ids, labels, batch_size=2, rnd=1)
    hits = (model.table.detach()[:, 0].argmax(dim=-1) == labels).double()
    assert [row["accuracy"] for row in evaluation.last] == [float(hits[p].mean()) for p in parts]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedit", "ffa"])
def test_a_lora_run_with_batched_adapters_computes_what_the_process_backend_computes(tmp_path, method):
    """backend: vmap on a LoRA run (groups of 2 clients through one pass of the base per step, 2
    workers each training a group on the shared base): every client's reported loss and steps,
    and each round's test loss, as the process backend has them, up to float32 rounding."""
    root, _ = play_root(tmp_path)

    def run(name, **changes):  # 6 clients of the roles' sequences, 4 a round, batches of 2
        data = {"dataset": "shakespeare_text", "root": str(root), "sequence_length": 16, "num_clients": 6}
        data["partition"] = "iid"
        local = {"batch_size": 2, "lr": 0.01, "optimizer": "adamw", "steps": 3}
        lora = {"rank": 2, "alpha": 4.0, "method": method}
        return lora_run(tmp_path, root, name, clients_per_round=4, data=data, local=local, lora=lora, **changes)

    process = run("process")
    batched = run("batched", backend="vmap", vmap_group_size=2, workers=2)
    assert batched.config["backend"] == "vmap" and len(process.client_records) == 8
    # the run says what it trained: its adapters (rank 2 on c_attn, 16 wide, 48 out) of the whole model
    trained = 2 * 48 + (2 * 16 if method == "fedit" else 0)
    for history in (process, batched):
        assert history.summary["lora"] == {"method": method, "rank": 2}
        assert history.summary["trainable_parameters"] == trained < history.summary["total_parameters"]

    def of(history, key):
        return [record[key] for record in history.client_records]

    assert of(batched, "client") == of(process, "client") and of(batched, "steps") == of(process, "steps")
    # a few float32 roundings of a loss of about 5 (log 256 at the start), compounded over 2 rounds
    assert of(batched, "train_loss") == pytest.approx(of(process, "train_loss"), rel=1e-4)
    assert batched.test_loss == pytest.approx(process.test_loss, rel=1e-4)


@pytest.mark.slow
def test_fedsa_lora_averages_the_a_matrices_and_keeps_each_clients_b(tmp_path):
    """FedSA-LoRA's round from its paper's equations, against FedIT's round on the same clients
    (whose local training is the same in a first round: both start from the global A and B = 0):
    the global A is FedIT's (the sample-weighted mean of the clients' A), the global B stays at
    zero, and the clients' kept B, averaged by their samples, are FedIT's global B."""
    from fedsim.core.files import read_checkpoint

    root, _ = play_root(tmp_path)
    fedit = lora_run(tmp_path, root, "fedit", rounds=1)
    fedsa = lora_run(tmp_path, root, "fedsa", rounds=1, algorithm="fedsa_lora")
    model = char_transformer((16,), 256, layers=1, heads=2, width=16)
    apply_lora(model, LoraConfig(rank=2, alpha=4.0), "char_transformer")
    b = torch.cat([torch.full((p.numel(),), "lora_B" in n) for n, p in model.named_parameters() if p.requires_grad])
    ours, theirs = (read_checkpoint(h.run_dir / "checkpoint.pt") for h in (fedsa, fedit))
    torch.testing.assert_close(ours["global"][~b], theirs["global"][~b], rtol=0, atol=0)
    assert not ours["global"][b].any() and theirs["global"][b].abs().max() > 0
    (kept,) = ours["client_state"].values()
    samples = {r["client"]: r["samples"] for r in fedsa.client_records}
    assert sorted(kept) == sorted(samples) == [0, 1]
    mean = sum(kept[c] * samples[c] for c in kept) / sum(samples.values())
    # the same weighted mean, rounded in another order: a few float32 units of the largest term
    largest = max(float(kept[c].abs().max()) for c in kept)
    torch.testing.assert_close(mean, theirs["global"][b], rtol=0, atol=4 * 2.0**-24 * largest)


def test_fedsa_lora_needs_adapters_whose_a_and_b_both_train(tmp_path):
    root, _ = play_root(tmp_path)
    base = {"model": "char_transformer", "algorithm": "fedsa_lora", "workers": 0, "rounds": 1, "clients_per_round": 2}
    base["data"] = {"dataset": "shakespeare_text", "root": str(root), "num_clients": 2, "sequence_length": 16}
    for lora in ({"rank": 0}, {"rank": 2, "method": "ffa"}):
        with pytest.raises(ConfigError, match=r"^config: algorithm: fedsa_lora shares LoRA's A matrices"):
            fedsim.run({**base, "lora": lora}, out=tmp_path / "run", quiet=True)


def with_adapters_that_move(model: nn.Module, seed: int) -> nn.Module:
    """``model``'s B matrices drawn away from zero, so that its adapters change what it computes."""
    g = torch.Generator().manual_seed(seed)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.data = torch.randn(parameter.shape, generator=g) * 0.5
    return model.eval()


def test_scoring_folds_the_adapters_into_their_layers_and_computes_what_pefts_forward_computes():
    """evaluate runs each adapted layer on W + s B A, not W x + s B (A x): equal up to float32
    rounding of the layers' sums (fan-in at most 4 x 32 here; on logits of a few units, 1e-5 is about
    a hundred float32 rounding errors), the weights untouched and peft's forward back once scoring ends."""
    lora = LoraConfig(rank=4, alpha=8, dropout=0.0, target_modules=["c_attn", "c_fc"])
    model = with_adapters_that_move(apply_lora(char_transformer((16,), 12, layers=2, width=32, heads=2), lora, "m"), 1)
    g = torch.Generator().manual_seed(2)
    ids, targets = torch.randint(0, 12, (64, 16), generator=g), torch.randint(0, 12, (64, 16), generator=g)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with torch.no_grad():
        pefts = model(ids)
        with merged_adapters(model):
            layers = [m for m in model.modules() if "forward" in vars(m)]
            folded = model(ids)
    assert len(layers) == 4  # c_attn and c_fc of both blocks
    assert not any("forward" in vars(m) for m in model.modules())
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
    base = copy.deepcopy(model)
    for name, parameter in base.named_parameters():
        if "lora_B" in name:
            parameter.data.zero_()
    with torch.no_grad():
        moved = (pefts - base(ids)).abs().max()
    assert (pefts - folded).abs().max() < 1e-5 < 0.1 < moved  # the adapters matter, and the fold keeps them
    _, loss = evaluate(model, ids, targets, 16)
    assert loss == pytest.approx(F.cross_entropy(pefts.flatten(0, 1), targets.flatten()).item(), abs=1e-5)


def test_a_gpt2_layer_that_keeps_its_weight_transposed_is_folded_in_its_own_layout():
    """transformers' Conv1D holds W as [in, out] (peft's fan_in_fan_out): the fold must follow it."""
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=20, n_positions=8)
    model = transformers.GPT2LMHeadModel(config)
    peft.inject_adapter_in_model(peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True), model)
    model = with_adapters_that_move(model, 4)
    ids = torch.randint(0, 20, (3, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        pefts = model(ids).logits
        with merged_adapters(model):
            folded = model(ids).logits
    assert (pefts - folded).abs().max() < 1e-5
