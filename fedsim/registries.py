"""Every name table in one place: for config validation and ``fedsim list``."""
from __future__ import annotations

import torch

from .aggregation import AGGREGATORS
from .aggregation import get as get_aggregator
from .attacks import ATTACKS
from .client import ALGORITHMS
from .data import DATASETS, PARTITIONS
from .errors import ConfigError
from .models import MODELS
from .server_opt import SERVER_OPTIMIZERS

ALL = {
    "datasets": DATASETS,
    "partitions": PARTITIONS,
    "models": MODELS,
    "algorithms": ALGORITHMS,
    "aggregators": AGGREGATORS,
    "server optimizers": SERVER_OPTIMIZERS,
    "attacks": ATTACKS,
}


_PROBE_ROWS = 2000


def check_options(cfg, fail) -> None:
    """Check options that depend on other keys, before any data is loaded or process started.

    The aggregator is built and called once on a tiny stack of ``clients_per_round`` rows, so
    a rule that cannot work with that many clients (Krum with f >= k/2, say) says so now. Above
    _PROBE_ROWS rows the probe itself would be costly (Krum's distances are k x k); such a
    rule still checks its options when the first round calls it.
    """
    try:
        rule = get_aggregator(cfg.aggregator, **cfg.aggregator_options)
        k = cfg.clients_per_round
        if k <= _PROBE_ROWS:
            rule(torch.randn(k, 3, generator=torch.Generator().manual_seed(0)), torch.ones(k))
    except ConfigError as e:
        fail("aggregator_options", str(e).removeprefix("aggregator_options: "))
    if cfg.attack.type != "none" and cfg.attack.fraction == 0:
        fail("attack.fraction", f"attack.type is {cfg.attack.type} but fraction is 0; set a fraction in (0, 1)")
