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
        module: torch.nn.Module,
        load: Callable[[int], object],
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        rnd: int,
    ) -> dict:
        """The three columns for every client's own model: ``load(c)`` puts client c's weights into
        ``module``, which then scores c's split."""
        module.eval()
        device = next(module.parameters()).device
        correct = torch.zeros(len(self.samples), dtype=torch.int64, device=device)
        targets = torch.zeros_like(correct)
        for client, index in enumerate(self.index.split(self.samples.tolist())):
            load(client)
            for part in index.split(batch_size):
                xb, yb = x[part].to(device, non_blocking=True), y[part].to(device, non_blocking=True)
                correct[client] += tasks.hits(module(xb), yb).sum()
                targets[client] += tasks.scored(yb).sum()
        return self._spread(correct, targets, rnd, "personal")

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
            }
            for c, (n, a) in enumerate(zip(self.samples.tolist(), accuracies.tolist()))
        ]
        return spread(accuracies.numpy())
