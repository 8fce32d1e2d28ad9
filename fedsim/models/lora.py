"""The ``lora:`` section: parameter-efficient fine-tuning with LoRA adapters (Hu et al. 2022,
"LoRA: Low-Rank Adaptation of Large Language Models"), placed by Hugging Face ``peft``.

Its keys, their defaults and meanings are declared once, in ``LoraConfig`` below (``fedsim list
keys`` prints them).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from ..core.checks import Checks, is_integer
from ..core.errors import ConfigError, cut, install, shown
from ..core.registry import Registry
from ..core.sections import option
from ..core.streams import LORA_RANKS, generator


def _without_adapters(key: str, lora: Any, config: Any) -> str | None:
    return None if lora.rank > 0 else "lora.rank is 0: no adapters"


@dataclass
class LoraConfig:
    """The ``lora:`` section (see the module's docstring)."""

    rank: int = option(
        0,
        "r of every LoRA adapter; `0`: no adapters, every parameter is trained. Otherwise only the adapters "
        "train, travel, are aggregated and checkpointed (see [Language models](language-models.md))",
    )
    alpha: float = option(16.0, "the adapters' output is scaled by alpha / rank", unread=_without_adapters)
    dropout: float = option(0.0, "dropout on an adapter's input, in [0, 1)", unread=_without_adapters)
    target_modules: Any | None = option(
        None,
        "the layers to adapt: a name (suffix), a list of them, or `all-linear`; `null`: the model's own list",
        unread=_without_adapters,
    )
    method: str = option(
        "fedit",
        "`fedit`: A and B trained and averaged (FedIT); `ffa`: A frozen, B alone trained and sent (FFA-LoRA)",
        unread=_without_adapters,
    )
    share_base: bool = option(
        True, "the frozen base: one copy every worker reads; `false`: a copy per worker", unread=_without_adapters
    )
    client_ranks: Any | None = option(
        None,
        "each client's own rank, at most `rank`, for the algorithms that let ranks differ (those that read "
        "it: `hetlora`, `flora`): `null` (every client `rank`), a list of one rank per client, or drawn once per "
        "client: `{choice: [r1, r2, ...]}` (each equally likely) or `{uniform: [low, high]}` (whole numbers)",
        unread=_without_adapters,  # and by the algorithms that do not read it (Algorithm.reads)
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def check(self) -> None:
        """The section's values, each refused in one line."""
        checks = Checks("lora")
        checks.at_least("rank", self.rank, 0)
        if self.alpha <= 0:
            checks.fail("alpha", f"must be > 0, got {self.alpha}")
        checks.within("dropout", self.dropout, 0, 1, "[)")
        checks.choice("method", self.method, METHODS)
        if self.client_ranks is not None:
            _rank_spec(checks, self.client_ranks, self.rank)
        targets = self.target_modules
        if not (targets is None or _names(targets)):
            checks.fail(
                "target_modules",
                f"must be a layer name, a list of them or all-linear (null: the model's), got {shown(targets)}",
            )


METHODS = Registry("LoRA method")
METHODS.register("fedit", "A and B trained, and averaged each as FedAvg averages any parameter (FedIT)")("fedit")
METHODS.register("ffa", "A frozen at its shared initialisation, B alone trained and sent: exact averaging (FFA-LoRA)")(
    "ffa"
)
INSTALL = install("llm")
RANK_FORMS = "null, a list of one rank per client, {choice: [r1, r2, ...]} or {uniform: [low, high]}"


def _rank_spec(checks: Checks, spec: Any, most: int) -> tuple[str, list[int]]:
    """``lora.client_ranks`` as (form, ranks): ("list", one per client), ("choice", the ranks
    drawn from) or ("uniform", [low, high]); every rank a whole number in [1, lora.rank]."""
    if isinstance(spec, list):
        form, ranks = "list", spec
    elif isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in ("choice", "uniform"):
        ((form, ranks),) = spec.items()
        if not isinstance(ranks, list) or not ranks or (form == "uniform" and len(ranks) != 2):
            checks.fail(
                "client_ranks",
                f"{form} takes {'[low, high]' if form == 'uniform' else '[r1, r2, ...]'}, got {shown(ranks)}",
            )
    else:
        checks.fail("client_ranks", f"must be {RANK_FORMS}, got {shown(spec)}")
    if not ranks or not all(is_integer(r) and 1 <= r <= most for r in ranks):
        checks.fail("client_ranks", f"ranks must be whole numbers in [1, lora.rank = {most}], got {shown(ranks)}")
    if form == "uniform" and ranks[0] > ranks[1]:
        checks.fail("client_ranks", f"uniform takes [low, high] with low <= high, got {shown(ranks)}")
    return form, [int(r) for r in ranks]


def client_ranks(lora: LoraConfig, num_clients: int, seed: int) -> torch.Tensor:
    """Every client's rank ([N] int64), as ``lora.client_ranks`` sets them: the same whatever the
    process that asks, since a drawn rank comes from the run's seed alone."""
    checks = Checks("lora")
    if lora.client_ranks is None:
        return torch.full((num_clients,), lora.rank, dtype=torch.int64)
    form, ranks = _rank_spec(checks, lora.client_ranks, lora.rank)
    if form == "list":
        if len(ranks) != num_clients:
            checks.fail(
                "client_ranks", f"a list holds one rank per client: {num_clients} (data.num_clients), got {len(ranks)}"
            )
        return torch.tensor(ranks, dtype=torch.int64)
    rng = generator(LORA_RANKS, seed)
    drawn = rng.choice(ranks, num_clients) if form == "choice" else rng.integers(ranks[0], ranks[1] + 1, num_clients)
    return torch.as_tensor(drawn, dtype=torch.int64)


def _names(value: object) -> bool:
    if isinstance(value, str):
        return bool(value.strip())
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) and v.strip() for v in value)


def apply_lora(module: nn.Module, lora: LoraConfig, model_name: str) -> nn.Module:
    """``module`` with LoRA adapters on its target layers, in place, everything else frozen.

    fedit (FedIT: Zhang et al. 2024, "Towards Building the Federated GPT: Federated Instruction
    Tuning"): A and B are trained and the server averages each, as FedAvg averages any
    parameter. ffa (FFA-LoRA: Sun et al. 2024, "Improving LoRA in Privacy-preserving Federated
    Learning"): A stays at its initialisation, the same for every client, and only B is trained,
    so the mean of the clients' products B_i A is the product of the mean B with A: averaging is
    exact, where averaging A and B apart is not. A is initialised as peft does (Kaiming-uniform)
    and B at zero, so the model starts as the base."""
    try:
        import peft
    except ImportError:
        raise ConfigError(f"lora: adapters are placed by peft, which is not installed: {INSTALL}") from None
    targets = lora.target_modules or getattr(module, "lora_targets", None)
    # a transformers model (an hf: model's .model) gets peft's default layers for its architecture
    inner = getattr(module, "model", None)
    host = inner if isinstance(inner, nn.Module) and hasattr(inner, "config") else module
    if targets is None and host is module:
        raise ConfigError(f"lora.target_modules: name the layers of {model_name} to adapt (or all-linear)")
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(targets) if isinstance(targets, (list, tuple)) else targets,
    )
    try:
        peft.inject_adapter_in_model(config, host)
    except (ValueError, TypeError) as e:  # no layer matched, or a layer type peft cannot adapt
        raise ConfigError(f"lora.target_modules: {cut(str(e).splitlines()[0], 200)} (model {model_name})") from None
    trained = "lora_B" if lora.method == "ffa" else "lora_"
    for name, parameter in module.named_parameters():
        parameter.requires_grad = trained in name
        if "lora_" in name and parameter.is_floating_point():
            parameter.data = parameter.data.float()  # adapters in float32 on a bf16 base, as peft's autocast does
    return module


# ----------------------------------------------------------------------------- scoring


@contextmanager
def merged_adapters(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` whose LoRA layers (peft's) each run their frozen layer on W + scaling * B A, made
    as the call needs it, instead of adding scaling * B (A x) to its output: the product, the
    scaling and the sum are three passes over the layer's output, which cost scoring as much as
    the frozen layer itself. The same function up to float rounding; the weights are not touched,
    and a layer with DoRA, a bias of its own or several active adapters keeps peft's forward."""
    layers = [m for m in module.modules() if _mergeable(m)]
    try:
        for layer in layers:
            layer.forward = partial(_merged_forward, layer)  # an instance attribute: the class's is back after
        yield module
    finally:
        for layer in layers:
            del layer.forward


def _mergeable(m: nn.Module) -> bool:
    if not (hasattr(m, "get_delta_weight") and isinstance(getattr(m, "lora_B", None), nn.ModuleDict)):
        return False
    active = list(getattr(m, "active_adapters", ()))
    if len(active) != 1 or getattr(m, "merged", True) or getattr(m, "disable_adapters", True):
        return False
    key = active[0]
    dora = getattr(m, "use_dora", {}).get(key, False)
    return key in m.lora_B and m.lora_B[key].bias is None and not dora and hasattr(m.base_layer, "weight")


def _merged_forward(layer: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    weight = layer.base_layer.weight
    merged = weight + layer.get_delta_weight(layer.active_adapters[0]).to(weight.dtype)  # in the base's layout
    return torch.func.functional_call(layer.base_layer, {"weight": merged}, (x, *args), kwargs)


# ----------------------------------------------------------------------------- batched adapters


class GroupedLinear(nn.Module):
    """One adapter matrix (an A or a B) for a group of c clients at once: the group's rows,
    stacked client after client (``[rows, ..., in]``), each through its own client's
    ``weight[i]`` (``[c, out, in]``), so that the frozen layer it adapts computes all the
    group's rows in one pass (as mLoRA fuses several adapters' batches). ``rows``: how many
    rows each client has (None: as many each, one batched matmul)."""

    def __init__(self, weight: torch.Tensor, rows: list[int] | None = None):
        super().__init__()
        self.weight = weight  # a plain tensor: the trainer owns it and asks autograd for its gradient
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(x.dtype)
        if self.rows is None:
            rows = x.reshape(len(weight), -1, x.shape[-1])
            return torch.bmm(rows, weight.transpose(1, 2)).reshape(*x.shape[:-1], -1)
        return torch.cat([part @ w.T for part, w in zip(x.split(self.rows), weight)])


def groupable(module: nn.Module) -> bool:
    """Whether every parameter ``module`` trains is a LoRA adapter matrix that ``GroupedLinear``
    can stand in for (peft's A or B of a linear layer)."""
    trained = [name for name, p in module.named_parameters() if p.requires_grad]
    return bool(trained) and all(_adapter_slot(module, name) is not None for name in trained)


def _adapter_slot(module: nn.Module, name: str) -> tuple[nn.ModuleDict, str] | None:
    """The ModuleDict and key that hold the adapter whose weight is the parameter ``name``."""
    path, _, attribute = name.rpartition(".")
    holder_path, _, key = path.rpartition(".")
    if attribute != "weight" or holder_path.rpartition(".")[2] not in ("lora_A", "lora_B"):
        return None
    holder = module.get_submodule(holder_path)
    linear = holder[key] if isinstance(holder, nn.ModuleDict) and key in holder else None
    return (holder, key) if isinstance(linear, nn.Linear) and linear.bias is None else None


@contextmanager
def grouped_adapters(
    module: nn.Module, weights: dict[str, torch.Tensor], rows: list[int] | None = None
) -> Iterator[nn.Module]:
    """``module`` with each adapter named in ``weights`` (its parameter's name -> the group's
    ``[c, out, in]``) replaced by a ``GroupedLinear``, for one forward pass of a group's rows
    (``rows``: each client's number of them; None: as many each)."""
    swapped = []
    try:
        for name, weight in weights.items():
            holder, key = _adapter_slot(module, name)
            swapped.append((holder, key, holder[key]))
            holder[key] = GroupedLinear(weight, rows)
        yield module
    finally:
        for holder, key, adapter in swapped:
            holder[key] = adapter


# ----------------------------------------------------------------------------- adapters in the flat weights


@dataclass(frozen=True)
class Adapter:
    """One adapted layer's A ([rank, fan_in]) and B ([fan_out, rank]) as they lie, row-major, in
    the flat trained weights, so that a method can read and write them there for any number of
    clients at once (``w``: [..., n])."""

    layer: str  # the adapted layer's module name
    a_start: int
    b_start: int
    rank: int
    fan_in: int
    fan_out: int
    scaling: float  # peft's alpha / rank: the layer adds scaling * B A x

    def a(self, w: torch.Tensor) -> torch.Tensor:
        return w[..., self.a_start : self.a_start + self.rank * self.fan_in].unflatten(-1, (self.rank, self.fan_in))

    def b(self, w: torch.Tensor) -> torch.Tensor:
        return w[..., self.b_start : self.b_start + self.fan_out * self.rank].unflatten(-1, (self.fan_out, self.rank))

    def product(self, w: torch.Tensor) -> torch.Tensor:
        """scaling * B A ([..., fan_out, fan_in]): what the adapter adds to the layer's weight."""
        return self.scaling * (self.b(w) @ self.a(w))


def adapters(module: nn.Module, method: str) -> list[Adapter]:
    """The adapters of ``module`` (peft's, one per adapted layer) in the flat trained weights, in
    the order of ``named_parameters``; a ConfigError naming ``method`` where another parameter
    trains or A does not (FFA-LoRA)."""
    trained = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    starts, offset = {}, 0
    for name, p in trained:
        starts[name] = offset
        offset += p.numel()
    shapes, found = {name: p.shape for name, p in trained}, []
    for name, shape in shapes.items():
        layer, _, rest = name.partition(".lora_B.")  # rest: "<adapter name>.weight"
        a_name = f"{layer}.lora_A.{rest}"
        if rest and a_name in shapes:
            (fan_out, _), (rank, fan_in) = shape, shapes[a_name]
            scaling = float(module.get_submodule(layer).scaling[rest.rpartition(".")[0]])
            found.append(Adapter(layer, starts[a_name], starts[name], rank, fan_in, fan_out, scaling))
    if not found or 2 * len(found) != len(trained):
        raise ConfigError(
            f"algorithm: {method} trains LoRA adapters, A and B both, and nothing else: it needs lora.rank > 0 "
            "and lora.method: fedit"
        )
    return found


def rank_mask(layout: list[Adapter], n: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """[n] float: 1 on the first ``rank`` components of every adapter (A's rows, B's columns),
    0 on the rest: a client of rank ``rank`` on adapters of the full rank."""
    mask = torch.zeros(n, device=device)
    for adapter in layout:
        adapter.a(mask)[:rank] = 1
        adapter.b(mask)[:, :rank] = 1
    return mask
