"""The keys of an experiment by what they mean for a run, and a config as dotted keys.

A run is what it computes. Some keys say only where and how fast it goes, some may change when
it resumes, and some tell the runs of one experiment apart without changing the experiment.
Run directories' names, resuming, sweeps and results grouped by experiment all ask these lists,
and only these. This module imports nothing, so that reading results needs neither torch nor the
features.
"""

from __future__ import annotations

from collections.abc import Iterator

# where and how fast a run goes, and where else its numbers are sent, not what it computes
PLACEMENT_KEYS = frozenset(
    {
        "workers",
        "worker_timeout",
        "checkpoint_every",
        "on_worker_failure",
        "eval_batch_size",
        "device",
        "client_state_limit_mb",
        "sharing_strategy",
        "data.root",
        "data.download",
        "data.placement",
        "lora.share_base",
        "trackers",
    }
)
# what a resumed run may change: those, how long it runs and how often it reports
RESUMABLE_KEYS = PLACEMENT_KEYS | {"rounds", "stop_at_accuracy", "eval_every", "eval_subset"}
# what runs that repeat one experiment may differ in: those, their name and seed, and the backend
# (vmap's dropout masks differ from the process backend's, equally valid draws of one experiment)
RUN_SPECIFIC_KEYS = PLACEMENT_KEYS | {"name", "seed", "backend"}


def flatten_config(config: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, value) pairs of a nested config dict."""
    for key, value in config.items():
        if isinstance(value, dict) and value:
            yield from flatten_config(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def defining(overrides: dict) -> dict:
    """The overrides that change what a run computes: all but where and how it ran (the
    ``RUN_SPECIFIC_KEYS``), though the seed counts."""
    return {key: value for key, value in overrides.items() if key == "seed" or key not in RUN_SPECIFIC_KEYS}
