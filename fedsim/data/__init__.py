"""Datasets as device-ready tensors, and their split among clients; the ``data:`` section
(``config.py``).

It may import results and core; models and everything above import it."""

from . import cifar100, hub, leaf  # noqa: F401 (they register their datasets)
from .datasets import DATASETS, Dataset, check_dataset_spec, from_tensors, load_dataset
from .partition import PARTITIONS, local_test_split, options_for, partition

__all__ = [
    "DATASETS",
    "PARTITIONS",
    "Dataset",
    "check_dataset_spec",
    "from_tensors",
    "load_dataset",
    "local_test_split",
    "options_for",
    "partition",
]
