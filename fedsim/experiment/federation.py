"""What every run starts from: the data split among the clients, and the initial global model.

Runs, ``fedsim partition`` and the benchmarks all start here, so they see the same clients and
the same initial weights for the same config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.streams import model_seed
from ..data import Dataset, load_dataset, options_for, partition
from . import components


@dataclass
class Federation:
    data: Dataset
    parts: list[torch.Tensor]  # one index tensor per client into data.train_x


def load_federation(cfg, datasets: dict | None = None) -> Federation:
    """``datasets``: those loaded already, kept by what was loaded; runs that differ in other
    keys (a sweep's, checked one after another) then read the files once."""
    d = cfg.data
    key = (d.dataset if isinstance(d.dataset, str) else id(d.dataset), str(d.root), d.limit)
    data = datasets.get(key) if datasets is not None else None
    if data is None:
        data = load_dataset(d.dataset, d.root, d.limit, d.download)
        if datasets is not None:
            datasets[key] = data
    return Federation(
        data, partition(data.train_y, d.partition, d.num_clients, cfg.seed, **options_for(d.partition, d))
    )


def initial_model(cfg, data: Dataset) -> torch.nn.Module:
    """The model, built from ``seed`` (so the same initial weights in every run of the config)
    and probed once on two training samples."""
    torch.manual_seed(model_seed(cfg.seed))
    module = components.build_model(cfg.model, data.input_shape, data.num_classes)
    components.probe_model(cfg.model, module, data.train_x[:2], data.num_classes)
    return module
