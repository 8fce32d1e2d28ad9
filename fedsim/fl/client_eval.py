"""Per-client evaluation: the global model scored on every client's own test split.

With ``data.test_partition: true`` every client holds a test split: a natural client (data
with clients of its own, ``data.partition: natural``) its own test samples, any other one a split
with its own label mix (``data.local_test_split``): each class's test samples are divided among the clients in
proportion to how many training samples of that class each one holds, with a stream of its own
seeded by ``seed``. This is how personalized-FL papers evaluate on label-skewed splits of a
common test set (FedRep, Collins et al. 2021; LG-FedAvg, Liang et al. 2020): a client is scored
on data distributed like its own. The splits come from the test set, not from the clients'
training samples, so turning per-client evaluation on changes no trained weight.

With ``eval_per_client: true`` too, every evaluated round scores the global model on every
client's split (one batched pass over their union, which the splits cover without overlap, on
the server's device) and reports the spread of the clients' accuracies, each client counting
once whatever its size (``spread``):

    client_accuracy_mean  the mean of the clients' accuracies
    client_accuracy_std   their standard deviation over the clients (divided by n, not n - 1: the
                          clients are the whole federation, not a sample of it)
    client_accuracy_p10   their 10th percentile, how the worst tenth of the clients fare

Under an algorithm with personal models (Ditto, FedPer, FedRep: ``Algorithm.personal_weights``)
each client is scored with its own model instead, one pass over its split per client; the
``model`` column of ``client_accuracy.csv`` and ``client_eval_model`` in ``summary.json`` say
which (``global`` or ``personal``). ``test_accuracy`` stays the global model's on the whole test
set.

A client whose split is empty (a class mix so small that rounding leaves it no test sample) has
no accuracy: it is left out of the three numbers, and its rows in ``client_accuracy.csv`` say
0 samples and accuracy nan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.func import functional_call, vmap

from ..core.flat import FlatModel, flat_layout
from ..data.partition import Parts
from ..models import tasks

CLIENT_ACCURACY_COLUMNS = ("client_accuracy_mean", "client_accuracy_std", "client_accuracy_p10")


def spread(accuracies: np.ndarray | Sequence[float]) -> dict:
    """The three columns from the clients' accuracies (NaN: a client without test samples, left
    out). The 10th percentile is linear between order statistics (numpy's default, Hyndman and
    Fan's type 7): with the n accuracies sorted, a_0 <= ... <= a_{n-1}, and h = 0.1 (n - 1), it
    is a_{floor h} + (h - floor h)(a_{floor h + 1} - a_{floor h}). All NaN when no client has one."""
    values = np.asarray(accuracies, dtype=np.float64)
    values = values[~np.isnan(values)]
    if not len(values):
        return dict.fromkeys(CLIENT_ACCURACY_COLUMNS, math.nan)
    return {
        "client_accuracy_mean": float(values.mean()),
        "client_accuracy_std": float(values.std()),
        "client_accuracy_p10": float(np.percentile(values, 10)),
    }


class ClientEvaluation:
    """Every client's test split as one index into the test set, and the owner of each entry.

    ``score`` fills ``last``: the rows of ``client_accuracy.csv`` for the round it scored (see
    callbacks.ClientAccuracyFile)."""

    def __init__(
        self, test_parts: Parts | list[torch.Tensor], device: torch.device, names: Sequence[str] | None = None
    ):
        self.names = names  # each client's own id in the data, where it has one
        parts = test_parts if isinstance(test_parts, Parts) else Parts.of(test_parts)
        self.samples = parts.sizes()  # [N]
        self.index = parts.indices.to(device)  # where the test set lives
        self.owner = torch.repeat_interleave(torch.arange(len(parts)), self.samples)
        self.last: list[dict] = []

    def warning(self) -> str | None:
        empty = int((self.samples == 0).sum())
        if not empty:
            return None
        return (
            f"eval_per_client: {empty} of {len(self.samples)} clients get no test sample from data.test_partition; "
            f"they are left out of client_accuracy_mean, _std and _p10"
        )

    @torch.inference_mode()
    def score(self, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int, rnd: int) -> dict:
        """The three columns for the global model ``module`` on the test set (x, y); one host sync.
        Batches gather their samples from x, which may live in host memory (data.placement)."""
        module.eval()
        device = next(module.parameters()).device
        owner = self.owner.to(device)
        correct = torch.zeros(len(self.samples), dtype=torch.int64, device=device)
        targets = torch.zeros_like(correct)
        for index, who in zip(self.index.split(batch_size), owner.split(batch_size)):
            xb, yb = x[index].to(device, non_blocking=True), y[index].to(device, non_blocking=True)
            correct.index_add_(0, who, tasks.hits(module(xb), yb))
            targets.index_add_(0, who, tasks.scored(yb))
        return self._spread(correct, targets, rnd, "global")

    @torch.inference_mode()
    def score_personal(
        self,
        model: FlatModel,
        scorer: torch.nn.Module,
        weights_of: Callable[[list[int]], torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        rnd: int,
        trained: set[int],
    ) -> dict:
        """The three columns for every client's own model: ``weights_of(clients)`` gives their
        weights ([c, P], the layout of ``model.flat``), and each client's model scores its split,
        through ``scorer`` (``model.module``, or the algorithm's module around it: FedProto's nearest
        prototype); a client not in ``trained`` has the model it would start from (``last`` says which).

        Clients with a few test samples (``_GROUPED_SAMPLES``) are scored a group at a time, by
        ``torch.func.vmap`` over their stacked weights (clients of alike split sizes together, each
        split padded to the group's largest with samples that are not counted): one pass per group
        instead of one per client, whose cost would be mostly per-call overhead. A larger split, a
        model with a frozen base (LoRA, whose adapters are batched otherwise) and an algorithm's own
        scorer load each client's weights into ``model`` in turn."""
        module = model.module
        module.eval()
        scorer.eval()
        device = model.flat.device
        correct = torch.zeros(len(self.samples), dtype=torch.int64, device=device)
        targets = torch.zeros_like(correct)
        splits = self.index.split(self.samples.tolist())
        sizes = self.samples.tolist()
        small = min(batch_size, _GROUPED_SAMPLES)
        grouped = (
            []
            if model.base or scorer is not module
            else [c for c in self.samples.argsort(stable=True).tolist() if 0 < sizes[c] <= small]
        )
        for group in _groups(grouped, sizes, batch_size, max(1, _GROUP_VALUES // model.flat.numel())):
            hits, scored = _score_group(module, weights_of(group), [splits[c] for c in group], x, y, device)
            correct[group], targets[group] = hits, scored
        for client in sorted({c for c, n in enumerate(sizes) if n} - set(grouped)):  # no split: no accuracy
            model.flat.copy_(weights_of([client])[0])
            for part in splits[client].split(batch_size):
                xb, yb = x[part].to(device, non_blocking=True), y[part].to(device, non_blocking=True)
                correct[client] += tasks.hits(scorer(xb), yb).sum()
                targets[client] += tasks.scored(yb).sum()
        result = self._spread(correct, targets, rnd, "personal")
        for record in self.last:
            record["trained"] = int(record["client"] in trained)
        return result

    def _spread(self, correct: torch.Tensor, targets: torch.Tensor, rnd: int, model: str) -> dict:
        """Each client's accuracy over its scored targets (its samples' labels, or their tokens)."""
        accuracies = correct.cpu().double() / targets.cpu()  # 0 / 0: NaN, a client without samples
        self.last = [
            {
                "round": rnd,
                "client": c,
                "client_name": self.names[c] if self.names else None,
                "model": model,
                "samples": int(n),
                "accuracy": float(a),
                "trained": None,  # personal models only: whether the client's own model has trained yet
            }
            for c, (n, a) in enumerate(zip(self.samples.tolist(), accuracies.tolist()))
        ]
        return spread(accuracies.numpy())


_GROUP_VALUES = 1 << 24  # a group's stacked weights hold at most this many values (64 MiB in float32)
# splits of up to this many samples are scored in groups: a forward pass under vmap costs about twice
# a plain one per sample, which pays where a client's few samples leave a plain pass mostly overhead
# (benchmarks/bench_personal_scoring.py, mnist_cnn, one thread: groups 1.9x faster at 1 sample a client,
# 1.6x at 5, 0.8x at 10)
_GROUPED_SAMPLES = 8


def _groups(clients: list[int], sizes: list[int], batch_size: int, most: int) -> list[list[int]]:
    """``clients`` (in order of their split sizes) cut into consecutive groups of at most ``most``
    clients whose padded splits, the group's largest times its count, fit in ``batch_size``."""
    groups, group = [], []
    for client in clients:
        if group and (len(group) == most or (len(group) + 1) * sizes[client] > batch_size):
            groups.append(group)
            group = []
        group.append(client)
    return groups + [group] if group else groups


def _score_group(
    module: torch.nn.Module,
    weights: torch.Tensor,
    splits: list[torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each client's hits and scored targets ([c] each): client i's model (``weights[i]``, the layout
    of a FlatModel's flat weights: the trained parameters, then the floating-point buffers) on its
    split ``splits[i]``, padded to the longest by repeating its first sample, which is not counted."""
    longest = max(len(s) for s in splits)
    index = torch.stack([torch.cat([s, s[:1].expand(longest - len(s))]) for s in splits])
    real = torch.arange(longest)[None, :] < torch.tensor([len(s) for s in splits])[:, None]
    xb, yb = x[index.flatten()].to(device), y[index.flatten()].to(device)
    views, offset = {}, 0
    for name, tensor in flat_layout(module):
        views[name] = weights[:, offset : offset + tensor.numel()].view(len(splits), *tensor.shape)
        offset += tensor.numel()
    scores = vmap(lambda p, inputs: functional_call(module, p, (inputs,)))(
        views, xb.view(len(splits), longest, *x.shape[1:])
    )
    real = real.to(device)
    hits = tasks.hits(scores.flatten(0, 1), yb).view(len(splits), longest) * real
    scored = tasks.scored(yb).view(len(splits), longest) * real
    return hits.sum(dim=1), scored.sum(dim=1)
