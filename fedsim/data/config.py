"""The ``data:`` section: which dataset, where it is found, and how it is split among the clients.
Each key is declared once below (see core/sections.py); a partition's options are read only by
the partitions whose parameters name them (partition.py), and a run warns of one set for another.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..core.checks import Checks
from ..core.sections import option
from .hub import check_hub_options
from .partition import PARTITIONS, partition_options
from .text import check_tokenizer_spec, template_fields


def default_data_root() -> str:
    """Where datasets are read and downloaded: ``$FEDSIM_DATA``, else one cache folder for every
    run whatever directory it starts in (``$XDG_CACHE_HOME/fedsim/datasets``, by default
    ``~/.cache/fedsim/datasets``)."""
    if os.environ.get("FEDSIM_DATA"):
        return os.environ["FEDSIM_DATA"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "fedsim", "datasets")


def _not_taken_by_partition(key: str, data: Any, config: Any) -> str | None:
    if data.partition not in PARTITIONS or key in partition_options(data.partition):
        return None
    return f"data.partition {data.partition} does not use it"


@dataclass
class DataConfig:
    """The ``data:`` section."""

    dataset: Any = option(
        "mnist",
        "`mnist`, `fashion_mnist`, `cifar10`, `cifar100`, `femnist`, `shakespeare`, `shakespeare_plays`, "
        "`shakespeare_text` (the roles as running text, for language models), `synthetic`; `hf:<name or path>` "
        "(see [Hugging Face datasets](data.md#hugging-face-datasets)); a `.pt` / `.npz` file of your tensors; an "
        "import path (see [Extending fedsim](extending.md))",
    )
    root: str = option(
        doc="where datasets are found and downloaded: one folder for every run, whatever directory it starts in "
        "(`$XDG_CACHE_HOME/fedsim/datasets` where `XDG_CACHE_HOME` is set)",
        factory=default_data_root,
        shown_default="`$FEDSIM_DATA`, else `~/.cache/fedsim/datasets`",
    )
    partition: str = option(
        "iid",
        "`iid`, `contiguous`, `dirichlet`, `shards`, `label_k`, `quantity`, `gamma_similarity`, `natural` (the "
        "data's own clients), "
        "`pachinko` (see [Partitions](data.md#partitions))",
    )
    num_clients: int = option(
        10,
        "clients in the federation (`natural`: how many of the data's own clients, a seeded subset when fewer "
        "than it has)",
    )
    limit: int | None = option(None, "use only the first N training samples (quick runs)")
    seed: int | None = option(
        None,
        "the split's seed (the partition, the clients' test splits, `natural`'s subset of clients); `null`: the "
        "run's `seed`. A fixed value keeps one split under every seed of a sweep, as ByzFL's benchmark keeps its "
        "`data_distribution_seed`",
    )
    download: bool = option(True, "download a missing dataset into `data.root` (`false`: fail at once, offline)")
    placement: str = option(
        "auto",
        "where a GPU run keeps the dataset: `device`, `host` (batches are copied over), `auto` (on the device "
        "when it takes at most half of the free GPU memory)",
    )
    alpha: float = option(
        0.5,
        "`dirichlet`'s concentration (label skew; with `quantity` and `dirichlet` sizes, of the sizes); "
        "`pachinko`'s over the coarse labels",
        unread=_not_taken_by_partition,
    )
    beta: float = option(
        10.0, "`pachinko`: concentration over the fine labels within a coarse label", unread=_not_taken_by_partition
    )
    min_samples: int = option(
        1, "`dirichlet`: re-draw until every client has this many samples", unread=_not_taken_by_partition
    )
    balanced: bool = option(
        False,
        "`dirichlet`: NIID-Bench's cap, no more samples for a client holding N / num_clients (see "
        "[Partitions](data.md#partitions))",
        unread=_not_taken_by_partition,
    )
    gamma: float = option(
        0.5, "`gamma_similarity`: the share of the samples split at random", unread=_not_taken_by_partition
    )
    shards_per_client: int = option(2, "`shards`: label-sorted shards per client", unread=_not_taken_by_partition)
    classes_per_client: int = option(2, "`label_k`: classes per client", unread=_not_taken_by_partition)
    sigma: float = option(1.0, "`quantity`: log-normal spread of client sizes", unread=_not_taken_by_partition)
    quantity_skew: str = option(
        "lognormal", "`quantity`: `lognormal` or `dirichlet` client sizes", unread=_not_taken_by_partition
    )
    test_partition: bool = option(
        False,
        "give every client a test split with its own label mix, drawn from the test set (reported by `fedsim "
        "partition`; scored with `eval_per_client`)",
    )
    rotations: int = option(
        1,
        "planted clusters: client c's images, training and test split alike, turned by (c mod rotations) x 360 / "
        "rotations degrees: `1` none, `2` 0/180, `4` 0/90/180/270 (the IFCA paper's rotated MNIST; see "
        "[Planted clusters](data.md#planted-clusters))",
    )
    augment: bool | None = option(
        None, "training-time augmentation on the device; `null`: the dataset's default (on for CIFAR-10 and CIFAR-100)"
    )
    hf: dict | None = option(
        None,
        "`hf:` datasets: the columns and splits to use (`input`, `label`, or for text `text`: a column or a "
        "template over columns; `client`, `train`, `test`, `test_fraction`; see "
        "[Hugging Face datasets](data.md#hugging-face-datasets))",
    )
    tokenizer: str = option(
        "bytes",
        "text datasets: `bytes` (UTF-8 bytes, 256 ids, built in) or `hf:<name or folder>` (a `transformers` "
        "tokenizer; see [Language models](language-models.md))",
    )
    sequence_length: int = option(128, "text datasets: tokens a training sequence holds")

    def check(self) -> None:
        checks = Checks("data")
        check_hub_options(self.dataset, self.hf)
        if isinstance(self.hf, dict) and isinstance(self.hf.get("text"), str):
            template_fields(self.hf["text"])  # a template's braces, before any data is read
        check_tokenizer_spec(self.tokenizer)
        checks.within("sequence_length", self.sequence_length, 2, 1_000_000)
        if self.seed is not None:
            checks.at_least("seed", self.seed, 0)
        if self.limit is not None and self.limit < self.num_clients:
            checks.fail(
                "limit", f"must be >= data.num_clients ({self.num_clients}) so every client gets data, got {self.limit}"
            )
        if self.alpha <= 0:
            checks.fail("alpha", f"must be > 0, got {self.alpha}")
        if self.beta <= 0:
            checks.fail("beta", f"must be > 0, got {self.beta}")
        checks.at_least("sigma", self.sigma, 0)
        checks.at_least("min_samples", self.min_samples, 0)
        checks.at_least("shards_per_client", self.shards_per_client, 1)
        checks.at_least("classes_per_client", self.classes_per_client, 1)
        checks.one_of("quantity_skew", self.quantity_skew, ("lognormal", "dirichlet"))
        checks.one_of("placement", self.placement, ("auto", "device", "host"))
        if self.rotations not in (1, 2, 4) or isinstance(self.rotations, bool):
            checks.fail("rotations", f"must be 1, 2 or 4 (turns of 360, 180 or 90 degrees), got {self.rotations!r}")
        checks.choice("partition", self.partition, PARTITIONS)
