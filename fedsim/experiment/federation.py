"""What every run starts from: the data split among the clients, and the initial global model.

Runs, ``fedsim partition`` and the benchmarks all start here, so they see the same clients and
the same initial weights for the same config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.errors import ConfigError, DataError, ResourceError
from ..core.streams import model_seed
from ..data import Dataset, load_dataset, options_for
from ..data.partition import Parts, local_test_split, natural_test_split, split
from . import components
from .config import Config


class ClientNames(Sequence):
    """Each client's own id in the data, looked up when asked for: a million clients build no
    list of a million strings."""

    def __init__(self, names: Sequence[str], owners: torch.Tensor):
        self.names, self.owners = names, owners  # owners[c]: client c's own id, an index into names

    def __len__(self) -> int:
        return len(self.owners)

    def __getitem__(self, client: int) -> str:
        if not -len(self) <= client < len(self):
            raise IndexError(f"client {client} of {len(self)}")
        return self.names[int(self.owners[client])]


@dataclass
class Federation:
    data: Dataset
    parts: Parts  # one index tensor per client into data.train_x
    natural: bool = False  # the parts are the data's own clients (data.partition: natural)
    own_clients: torch.Tensor | None = None  # natural parts: each part's own client in the data (part_clients)
    seed: int = 0  # the seed the split was drawn with: data.seed, else the run's

    def client_names(self) -> ClientNames | None:
        """Each client's own id in the data (a LEAF writer, a play role, an ``hf:`` client value),
        where the parts are the data's own clients; None otherwise."""
        if self.own_clients is None or not self.data.client_names:
            return None
        return ClientNames(self.data.client_names, self.own_clients)

    def test_parts(self) -> Parts | list[torch.Tensor]:
        """Each client's own test split (data.test_partition): a natural client's own test
        samples where the data has them, else the test set dealt by each client's label mix."""
        data = self.data
        if self.own_clients is not None and data.test_clients is not None:
            return natural_test_split(self.own_clients, data.test_clients)
        return local_test_split(data.train_y, self.parts, data.test_y, self.seed)


def load_federation(cfg: Config, datasets: dict | None = None) -> Federation:
    """``datasets``: those loaded already, kept by what was loaded; runs that differ in other
    keys (a sweep's, checked one after another) then read the files once."""
    d = cfg.data
    key = (d.dataset if isinstance(d.dataset, str) else id(d.dataset), str(d.root), d.limit, repr(d.hf))
    key += (d.tokenizer, d.sequence_length)  # a text dataset's tokens (the others ignore both)
    data = datasets.get(key) if datasets is not None else None
    if data is None:
        data = load_dataset(d.dataset, d.root, d.limit, d.download, d.hf, d.tokenizer, d.sequence_length)
        if datasets is not None:
            datasets[key] = data
    options, seed = options_for(d.partition, d), split_seed(cfg)
    try:
        parts = split(data.train_y, d.partition, d.num_clients, seed, data.columns(), **options)
    except ConfigError as error:
        if d.limit is None or d.partition != "natural" or not str(error).startswith("data.num_clients"):
            raise
        raise ConfigError(f"{error}, in the first {d.limit:,} training samples that data.limit keeps") from None
    if d.partition != "natural":
        federation = Federation(data, parts, seed=seed)
    else:
        kept = part_clients(data, parts)  # natural splits data with clients of its own (Dataset.columns)
        federation = Federation(_kept_clients_tests(data, kept), parts, True, kept, seed)
    return rotated(federation, d.rotations) if d.rotations > 1 else federation


def split_seed(cfg: Config) -> int:
    """The seed of the run's split (the partition, the clients' test splits, natural's subset of
    clients): ``data.seed``, else the run's ``seed``."""
    return cfg.seed if cfg.data.seed is None else cfg.data.seed


def rotated(federation: Federation, rotations: int) -> Federation:
    """Planted clusters (data.rotations): client c's training samples and its test split turned by
    (c mod ``rotations``) quarter turns of 4 / ``rotations``, in a copy of the data (a loaded
    dataset is shared by the runs of a sweep). Test samples in no client's split (a class no
    client trains on) stay as they are: the global test set is the clients' splits as they see them."""
    data = federation.data
    shape = tuple(data.train_x.shape[1:])
    if data.tokens or len(shape) != 3 or (rotations == 4 and shape[1] != shape[2]):
        raise DataError(
            f"data.rotations: turns images by {360 // rotations} degrees, which needs "
            f"{'square ' if rotations == 4 else ''}images [C, H, W]; {data.name}'s inputs have shape {shape}"
        )
    groups = torch.arange(len(federation.parts)) % rotations

    def turned(x: torch.Tensor, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        owner = torch.zeros(len(x), dtype=torch.int64)  # each sample's group: that of the client holding it
        for client, part in enumerate(parts):
            owner[part] = groups[client]
        x = x.clone()
        for group in range(1, rotations):
            rows = (owner == group).nonzero().flatten().to(x.device)
            x[rows] = torch.rot90(x[rows], group * 4 // rotations, dims=(-2, -1))
        return x

    test_x = turned(data.test_x, federation.test_parts())
    data = dataclasses.replace(data, train_x=turned(data.train_x, federation.parts), test_x=test_x)
    return dataclasses.replace(federation, data=data)


def part_clients(data: Dataset, parts: Parts) -> torch.Tensor:
    """The data's own client (writer, role, user) of each part of ``natural``: its first sample's."""
    return data.train_clients[parts.firsts().to(data.train_clients.device)]


def _kept_clients_tests(data: Dataset, kept: torch.Tensor) -> Dataset:
    """The data with the test samples of the ``kept`` clients only (each natural part's own),
    where the data has clients of its own: a run of some of them is scored on their test samples
    (all of them when every client is kept), as LEAF scores a run on the union of its clients'
    test data."""
    if data.test_clients is None:
        return data
    if len(kept) == len(torch.unique(data.train_clients)):
        return data
    keep = torch.isin(data.test_clients, kept)
    if not keep.any():
        raise DataError(f"data.num_clients: the {len(kept)} clients drawn hold no test sample; draw more of them")
    return dataclasses.replace(
        data, test_x=data.test_x[keep], test_y=data.test_y[keep], test_clients=data.test_clients[keep]
    )


def _too_many_classes(data: Dataset) -> DataError | None:
    """For a model that could not be built for lack of memory: where the dataset's ``num_classes``
    is above the classes its labels use, the error that names num_classes, not only the memory."""
    if data.tokens:
        return None
    present = int(max(data.train_y.max(), data.test_y.max())) + 1
    if data.num_classes <= present:
        return None
    return DataError(
        f"data.dataset ({data.name}): num_classes is {data.num_classes:,} but the labels present go up to "
        f"{present - 1:,}; the model's output layer for so many classes does not fit in memory: set num_classes "
        f"to the classes there are (or leave it out: {present:,} from the labels)"
    )


def initial_model(cfg: Config, data: Dataset) -> torch.nn.Module:
    """The model, built from ``seed`` (so the same initial weights in every run of the config)
    and probed once on two training samples; refused where the run's backend cannot train it."""
    torch.manual_seed(model_seed(cfg.seed))
    try:
        module = components.run_model(cfg, data.input_shape, data.num_classes)
    except ResourceError as e:  # the machine ran out while the model was built
        raise _too_many_classes(data) or e  # noqa: B904 (the same error, or one line that explains it)
    components.probe_model(cfg.model, module, data.train_x[:2], data.num_classes, data.tokens)
    recurrent = next((m for m in module.modules() if isinstance(m, torch.nn.RNNBase)), None)
    if cfg.backend == "vmap" and recurrent is not None:  # no batching rule: at best one client at a time
        raise ConfigError(
            f"backend: vmap cannot train {components.describe(cfg.model)}, whose recurrent layer "
            f"({type(recurrent).__name__}) torch.func.vmap does not batch; use backend: process"
        )
    return module
