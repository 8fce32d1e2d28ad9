"""FedAvg (McMahan et al. 2017): local SGD from the global weights, nothing added."""

from . import ALGORITHMS
from .base import Algorithm


@ALGORITHMS.register("fedavg", "plain local SGD from the global weights (McMahan et al. 2017)")
class FedAvg(Algorithm):
    """Everything as in the base class."""
