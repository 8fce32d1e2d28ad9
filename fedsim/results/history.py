"""Runs read back from their run directories (see ``fedsim.rundir``): History, loading runs,
grouping repeats over seeds, and results tables.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
from collections.abc import Iterable
from pathlib import Path
from statistics import fmean, stdev
from typing import TYPE_CHECKING, Any

from ..core.errors import ConfigError, FedsimError, cut, did_you_mean, shown
from ..core.yamlfile import parse_yaml
from .keys import RUN_SPECIFIC_KEYS, flatten_config
from .rundir import COLUMNS, read_client_accuracy, read_clients, read_mapping, read_metrics

if TYPE_CHECKING:
    import pandas

logger = logging.getLogger("fedsim")


class History:
    """Per-round metrics of a run, one entry per evaluated round.

    Columns are attributes holding lists (``h.round``, ``h.test_accuracy``, ...; a language
    model's run also has ``h.test_perplexity``, and its test accuracy is token accuracy); ``h.rows``
    holds the same as dicts, ``h.client_records`` one dict per sampled client per round (the
    rows of clients.csv), ``h.client_accuracy`` one dict per client per evaluated round (the rows
    of client_accuracy.csv, with eval_per_client), ``h.config`` the resolved config as a dict,
    ``h.summary`` the summary, ``h.run_dir`` where the files are.
    """

    def __init__(
        self,
        rows: Iterable[dict] | None = None,
        config: dict | None = None,
        run_dir: Path | None = None,
        summary: dict | None = None,
        client_records: list[dict] | None = None,
    ):
        self.rows: list[dict] = list(rows or [])
        self.config = config or {}
        self.run_dir = run_dir
        self.summary = summary or {}
        self._client_records = client_records
        self._client_accuracy = None

    def __getattr__(self, name):
        if name in COLUMNS:  # a column a run directory of an older version lacks reads as None
            return [row.get(name) for row in self.rows]
        raise AttributeError(name)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def client_records(self) -> list[dict]:
        """One dict per sampled client per round (read from clients.csv when first asked for)."""
        if self._client_records is None:
            path = self.run_dir / "clients.csv" if self.run_dir else None
            self._client_records = read_clients(path) if path and path.is_file() else []
        return self._client_records

    @property
    def client_accuracy(self) -> list[dict]:
        """Each client's accuracy on its own test split with the model it uses (``model``: global or
        personal), one dict (round, client, samples, accuracy, ...) per client per evaluated round;
        [] for a run without eval_per_client.
        Read from client_accuracy.csv when first asked for."""
        if self._client_accuracy is None:
            path = self.run_dir / "client_accuracy.csv" if self.run_dir else None
            self._client_accuracy = read_client_accuracy(path) if path and path.is_file() else []
        return self._client_accuracy

    def to_pandas(self, clients: bool = False) -> pandas.DataFrame:
        """The rows (or, with ``clients=True``, the per-client rows) as a pandas DataFrame; an
        empty cell (a column of a feature the run had off) is NaN, so the columns stay numeric."""
        try:
            import pandas
        except ImportError:
            raise FedsimError("History.to_pandas needs pandas: pip install pandas") from None
        rows = self.client_records if clients else self.rows
        return pandas.DataFrame([{k: math.nan if v is None else v for k, v in row.items()} for row in rows])

    @property
    def name(self) -> str:
        return self.config.get("name") or (self.run_dir.name if self.run_dir else "run")

    def config_value(self, key: str) -> Any:
        """The value of a config key, dotted for sections (``"data.alpha"``)."""
        if key == "name":
            return self.name
        value, known = self.config, ""
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                # the keys at the level where it went wrong: a section's own, or the top level's
                level = value if isinstance(value, dict) else {}
                keys = [f"{known}{k}" + (".*" if isinstance(v, dict) and v else "") for k, v in level.items()]
                allowed = (
                    f"; its keys: {', '.join(keys)}"
                    if keys
                    else f"; {known[:-1]} is not a section"
                    if known
                    else "; it has no config"
                )
                raise FedsimError(
                    f"{key}: not a config key of run {self.name!r}{did_you_mean(key, _dotted(self.config))}{allowed}"
                )
            value, known = value[part], f"{known}{part}."
        return value

    @property
    def last_round(self) -> int:
        """The last evaluated round in metrics.csv (0 where there is none yet)."""
        return self.rows[-1]["round"] if self.rows else 0

    @property
    def unfinished(self) -> str | None:
        """How a run that did not finish ended, as its summary.json says ("interrupted at round 2 of
        10", "failed at round 2 of 10"); None for a finished run (one stopped by stop_at_accuracy
        included) and for a run without a status (an older version's, or one still running)."""
        status = self.summary.get("status")
        if status not in ("interrupted", "failed"):
            return None
        done = self.summary.get("rounds") or self.last_round
        planned = self.config.get("rounds")
        return f"{status} at round {done}" + (f" of {planned}" if planned else "")

    @property
    def final_accuracy(self) -> float:
        return self.rows[-1]["test_accuracy"] if self.rows else math.nan

    @property
    def best_accuracy(self) -> float:
        """The highest test accuracy of the rounds trained scored on the set the last round was (see
        ``scored_alike``): a round scored on eval_subset's samples is not weighed against the whole set."""
        return max((row["test_accuracy"] for row in scored_alike(self.rows)), default=math.nan)

    @property
    def scored_apart(self) -> bool:
        """Whether some evaluated round was scored on another set than the last (eval_subset's)."""
        return len(scored_alike(self.rows)) < sum(row["round"] > 0 for row in self.rows)

    @property
    def scored_on(self) -> int | None:
        """The test samples the final and best figures (and rounds to a target) are scored on: the
        last round's, the whole test set (None: a run of a version that did not record them)."""
        return self.rows[-1].get("test_samples") if self.rows else None

    @property
    def tokens(self) -> bool:
        """A token-level run (a language model): its rows have ``test_perplexity``, and its test
        accuracy is the token accuracy."""
        return any(row.get("test_perplexity") is not None for row in self.rows)

    @property
    def final_perplexity(self) -> float | None:
        """The last evaluated round's test perplexity; None for a classification run."""
        return self.rows[-1].get("test_perplexity") if self.rows else None

    @property
    def best_perplexity(self) -> float | None:
        """The lowest test perplexity of the rounds scored on the set the last round was; None for a
        classification run."""
        return min(
            (r["test_perplexity"] for r in scored_alike(self.rows) if r.get("test_perplexity") is not None),
            default=None,
        )

    @property
    def client_eval_model(self) -> str | None:
        """The model each client was scored with on its own test split (eval_per_client): "global"
        (FedAvg and every algorithm without a model of the client's own) or "personal", as
        summary.json says, or client_accuracy.csv while the run has no summary yet; None for a run
        that did not score its clients (or an older version's that did not say which)."""
        if self.final_client_accuracy is None:
            return None
        model = self.summary.get("client_eval_model")
        return model or next((row["model"] for row in self.client_accuracy if row.get("model")), None)

    @property
    def final_client_accuracy(self) -> float | None:
        """The last evaluated round's mean accuracy over the clients' own test splits
        (``client_accuracy_mean``; see client_eval_model for the model); None without eval_per_client."""
        means = self._client_means()
        return means[-1] if means else None

    @property
    def best_client_accuracy(self) -> float | None:
        """The highest mean accuracy over the clients' own test splits; None without eval_per_client."""
        return max(self._client_means(), default=None)

    def _client_means(self) -> list[float]:
        return [r["client_accuracy_mean"] for r in self.rows if r.get("client_accuracy_mean") is not None]

    @property
    def global_model_trained(self) -> bool:
        """False where the global model never trains (FedProto's clients exchange no weights), so
        that its test accuracy is the initial model's, as summary.json says."""
        return self.summary.get("global_model_trained") is not False

    @property
    def personal_accuracy(self) -> list[float] | None:
        """The mean accuracy of the clients' personal models on their own test splits, per
        evaluated round, where the run scored personal models (summary.json's client_eval_model
        is ``personal``); None for any other run."""
        if self.summary.get("client_eval_model") != "personal":
            return None
        return [math.nan if r.get("client_accuracy_mean") is None else r["client_accuracy_mean"] for r in self.rows]

    def __repr__(self) -> str:
        where = f" in {self.run_dir}" if self.run_dir else ""
        final = (
            f"final perplexity {self.final_perplexity:.2f}, token accuracy {self.final_accuracy:.4f}"
            if self.tokens
            else f"final accuracy {self.final_accuracy:.4f}"
        )
        return f"History({self.name!r}: {len(self.rows)} evaluated rounds, {final}{where})"


def load_run(run_dir: str | os.PathLike) -> History:
    """The metrics, config and summary of a run directory (finished or not)."""
    path = Path(run_dir)
    if not path.exists():
        raise FedsimError(f"{path}: no such run directory")
    if not (path / "metrics.csv").is_file():
        raise FedsimError(f"{path}: not a run directory ({not_a_run(path)})")
    config = read_mapping(path / "config.yaml", _yaml_mapping)
    summary = read_mapping(path / "summary.json", json.loads)
    return History(read_metrics(path / "metrics.csv"), config, path, summary)


def not_a_run(path: Path) -> str:
    """Why ``path`` is not a run directory, and where it holds runs (a sweep's), the pattern for them."""
    if not path.is_dir():
        return "a file"
    if any(path.glob("*/metrics.csv")):
        return f'no metrics.csv; it holds run directories, give "{path / "*"}" for them'
    return "no metrics.csv"


def load_runs(pattern: str | os.PathLike) -> list[History]:
    """Every run directory matching a glob pattern, e.g. ``runs/compare-*``, sorted by path; runs
    that failed or have no evaluated round yet are left out, with a warning each, and so are runs
    that were interrupted, unless every run that matches was (see ``finished``)."""
    paths = sorted(p for p in glob.glob(str(pattern), recursive=True) if (Path(p) / "metrics.csv").is_file())
    if not paths:
        raise FedsimError(f"{pattern}: no run directory (with a metrics.csv) matches")
    runs = finished([load_run(p) for p in paths])
    if not runs:
        raise FedsimError(f"{pattern}: every run directory that matches failed or has no evaluated round")
    return runs


def as_histories(runs: History | str | os.PathLike | Iterable, purpose: str) -> list[History]:
    """History objects from a mix of Histories, a sweep's runs (``fedsim.sweep``'s, their
    ``history``), run directories and glob patterns, for ``purpose`` ("to plot", "for the table");
    among several, runs that failed or have no evaluated round are left out with a warning."""
    if isinstance(runs, (str, os.PathLike, History)) or isinstance(getattr(runs, "history", None), History):
        runs = [runs]
    runs = list(runs)
    histories, skipped = [], []
    for run in runs:
        if isinstance(getattr(run, "history", None), History):
            run = run.history
        if isinstance(run, History):
            histories.append(run)
        elif not isinstance(run, (str, os.PathLike)):
            raise FedsimError(
                f"no runs {purpose}: got {shown(run)}; give History objects, a sweep's runs, run directories "
                "or a pattern such as 'runs/sweep/*'"
            )
        elif not Path(run).exists() and glob.has_magic(str(run)):
            histories.extend(load_runs(run))
        elif len(runs) > 1 and Path(run).exists() and not (Path(run) / "metrics.csv").is_file():
            skipped.append(f"{run} ({not_a_run(Path(run))})")
        else:
            histories.append(load_run(run))
    if skipped:  # the shell's expansion of a pattern also gives the files beside the runs (a sweep's runs.csv)
        logger.warning(f"left out, not run directories: {', '.join(skipped)}")
    if not histories:
        raise FedsimError(f"no runs {purpose}")
    if len(histories) == 1:  # a run on its own is drawn as far as it got, whatever became of it
        if not histories[0].rows:
            raise FedsimError(f"{histories[0].run_dir or histories[0].name}: no evaluated rounds {purpose} yet")
        return histories
    kept = finished(histories)  # among several (a pattern, or the shell's expansion of one): those with results
    if not kept:
        raise FedsimError(f"no runs {purpose}: every run given failed or has no evaluated round")
    return kept


def finished(histories: Iterable[History]) -> list[History]:
    """The runs that have results: a run that failed, or has no evaluated round yet, is left out
    with a warning naming it (and, for a failed one, why it failed). A run that was interrupted is
    left out too where some run finished, all of them in one warning: its last round is no final
    figure, and pooled with finished seeds it would pull their mean back to where it stopped. Where
    none finished, the interrupted runs are kept: what they got to is all there is, and tables and
    plots mark them (``History.unfinished``)."""
    kept = []
    for history in histories:
        where = history.run_dir or history.name
        if history.summary.get("status") == "failed":
            why = f" ({history.summary['error']})" if history.summary.get("error") else ""
            logger.warning(f"{where}: left out; the run failed{why}")
        elif not history.rows:
            logger.warning(f"{where}: left out; it has no evaluated round")
        else:
            kept.append(history)
    stopped = [h for h in kept if h.unfinished]
    if stopped and len(stopped) < len(kept):
        named = ", ".join(f"{h.run_dir or h.name} ({h.unfinished})" for h in stopped)
        logger.warning(f"left out as unfinished, beside the runs that finished: {named}")
        kept = [h for h in kept if not h.unfinished]
    return kept


def group_repeats(histories: Iterable[History], distinguish: Iterable[str] = ()) -> list[list[History]]:
    """Runs grouped by experiment: configs equal except ``RUN_SPECIFIC_KEYS`` (seed, name, ...).

    Keys in ``distinguish`` separate groups even when they are run-specific (plotting with
    ``label="seed"`` keeps every seed apart). Groups keep the order of their first run; a
    run without a config is a group of its own.
    """
    groups: dict = {}
    for index, history in enumerate(histories):
        key = _experiment_key(history.config, set(distinguish)) if history.config else index
        groups.setdefault(key, []).append(history)
    return [_one_per_seed(group) for group in groups.values()]


def _one_per_seed(group: list[History]) -> list[History]:
    """A group's runs, one per seed: a run of an experiment under a seed it already ran under is
    a copy, not another repeat (pooling the two would report a spread of 0 over "two seeds").
    The one kept is the finished one over an unfinished copy, then the one with more rounds, then
    the later in the group; a warning names both and why."""
    by_seed: dict = {}
    for history in group:
        seed = history.config.get("seed")
        if seed in by_seed:
            kept, why = _better_copy(by_seed[seed], history)
            other = history if kept is by_seed[seed] else by_seed[seed]
            logger.warning(
                f"{by_seed[seed].run_dir or by_seed[seed].name} and {history.run_dir or history.name} ran "
                f"the same experiment with seed {seed}; counting it once, as {kept.run_dir or kept.name} ({why}"
                f"{f'; the other was {other.unfinished}' if other.unfinished else ''})"
            )
            history = kept
        by_seed[seed] = history
    return list(by_seed.values())


def _better_copy(first: History, later: History) -> tuple[History, str]:
    """Of two runs of one experiment under one seed, the one to count, and why."""
    if bool(first.unfinished) != bool(later.unfinished):
        return (later, "finished") if first.unfinished else (first, "finished")
    rounds = [first.last_round, later.last_round]
    if rounds[0] != rounds[1]:
        kept = first if rounds[0] > rounds[1] else later
        return kept, f"it has more rounds, {max(rounds)} against {min(rounds)}"
    return later, "the later of the two"


def telling_apart(histories: list[History], keys: Iterable[str] = ()) -> list[str]:
    """The fewest config keys (dotted), beyond ``keys``, whose values tell the experiments of
    ``histories`` apart: each time the key that splits them into the most kinds, on a tie one that
    some run set on top of its file (summary.json's overrides: a sweep's grid), then the first in
    order. Run-specific keys (seed, workers, ...) are no candidates: repeats differ in them."""
    keys = list(keys)
    flat = [dict(flatten_config(h.config)) for h in histories]
    varying = set().union(*flat) - RUN_SPECIFIC_KEYS - set(keys)
    candidates = sorted(k for k in varying if len({repr(f.get(k)) for f in flat}) > 1)
    overridden = {k for h in histories for k in h.summary.get("overrides") or {}}

    def kinds(using: list[str]) -> int:
        return len({tuple(repr(f.get(k)) for k in [*keys, *using]) for f in flat})

    chosen: list[str] = []
    experiments = kinds(candidates)
    while kinds(chosen) < experiments:
        best = max(candidates, key=lambda k: (kinds([*chosen, k]), k in overridden))
        chosen.append(best)
        candidates.remove(best)
    return chosen


def _dotted(config: dict) -> list[str]:
    return [key for key, _ in flatten_config(config)]


def _experiment_key(config: dict, distinguish: set) -> tuple:
    """What a run computes, from its config.yaml. A key at null counts as absent: a run recorded
    before a key with a null default was added (data.seed, say) lacks it, and ran as null does."""
    return tuple(
        sorted(
            (k, repr(v))
            for k, v in flatten_config(config)
            if v is not None and (k not in RUN_SPECIFIC_KEYS or k in distinguish)
        )
    )


# the config keys describe_run names whatever they are set to; a title says a key outside them varies on its own
DESCRIBED_KEYS = frozenset(
    {
        "data.dataset",
        "data.partition",
        "data.num_clients",
        "model",
        "aggregator",
        "server_optimizer",
        "algorithm",
        "mode",
        "asynchronous.method",
        "lora.rank",
        "lora.method",
        "lora.client_ranks",
    }
)


def describe_run(
    config: dict, overrides: dict | None = None, aggregation: str | None = None, varying: Iterable[str] = ()
) -> str:
    """What a run computed, in one line: dataset and split, model (and its LoRA adapters),
    aggregation rule and server optimizer, algorithm (as config.yaml names them), then the keys
    set on top of its experiment (``overrides``, as summary.json keeps them), as many whole ones as
    fit. ``aggregation``: what takes the place of the rule where the algorithm replaces it or
    changes its weights (summary.json's ``aggregation``, Algorithm.aggregation). ``varying``: keys
    that differ among the runs described (a sweep's), said to vary before the keys set alike."""
    data = config.get("data") or {}
    rule = config.get("aggregator")
    replaced = aggregation is not None and aggregation != rule
    # an async run weighs updates by staleness, not by its (refused) rule
    if config.get("mode") == "async":
        server = f"async {(config.get('asynchronous') or {}).get('method')}"
    else:
        server = f"aggregation {aggregation}" if replaced else f"aggregator {rule}"
    optimizer = config.get("server_optimizer")
    if optimizer not in (None, "none") and config.get("mode") != "async":
        server += f", server optimizer {optimizer}"
    lora = config.get("lora") or {}
    # an algorithm that aggregates the adapters its own way is named for it, not LoRA's method (fedit's averaging)
    method = "" if replaced else f" {lora.get('method')}"
    adapters = f" with LoRA{method} rank {lora.get('rank')}" if (lora.get("rank") or 0) > 0 else ""
    ranks = lora.get("client_ranks") if adapters else None
    if isinstance(ranks, list) and ranks:
        adapters += f" (clients' ranks {min(ranks)} to {max(ranks)})"
    elif isinstance(ranks, dict):
        adapters += "".join(f" (clients' ranks {name} {_ranks(value)})" for name, value in ranks.items())
    text = (
        f"{data.get('dataset')} ({data.get('partition')}, {data.get('num_clients')} clients), "
        f"model {config.get('model')}{adapters}, {server}, algorithm {config.get('algorithm')}"
    )
    varying = list(varying)
    if varying:
        text += f"; {_whole(varying, 80)} {'vary' if len(varying) > 1 else 'varies'}"
    if overrides:
        text += "; with " + _whole([cut(f"{key}={_plain(value)}", 60) for key, value in overrides.items()], 120)
    return text


def _ranks(value) -> str:
    """A client_ranks choice or range as the description shows it: a long list by its size and ends."""
    if isinstance(value, list) and len(value) > 4 and all(isinstance(r, int) for r in value):
        return f"among {len(value)} from {min(value)} to {max(value)}"
    return cut(_plain(value), 40)


def _whole(items: list[str], limit: int) -> str:
    """``items`` joined by commas, as many whole ones as fit in ``limit`` characters (one at least)
    and how many more there are: an item is never cut in the middle."""
    kept: list[str] = []
    for item in items:
        if kept and len(", ".join([*kept, item])) > limit:
            break
        kept.append(item)
    left = len(items) - len(kept)
    return ", ".join(kept) + (f" and {left} more" if left else "")


def _plain(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def scored_alike(rows: list[dict]) -> list[dict]:
    """The rows of the rounds trained scored on the set the last one was (``test_samples``): with
    eval_subset, the rounds before the last are scored on a subset and the last on the whole test
    set, and a best figure or a round to a target that mixed the two would weigh a few samples'
    score against all of them. Round 0, the score of a fine-tuning run's base (``initial_weights``),
    is no figure of the run's training: it is left out too."""
    if not rows:
        return []
    last = rows[-1].get("test_samples")
    return [row for row in rows if row["round"] > 0 and row.get("test_samples") == last]


def rounds_to_target(history: History, target: float) -> int | None:
    """The first evaluated round whose test accuracy is at least ``target`` (a fraction), of those
    scored on the set the last round was (``scored_alike``: a round that reaches stop_at_accuracy on
    eval_subset is scored again on the whole set); None when none got there. With ``eval_every`` > 1
    only the evaluated rounds count."""
    return next((row["round"] for row in scored_alike(history.rows) if row["test_accuracy"] >= target), None)


def mean_and_sd(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1); the deviation of one value is 0, of none nan."""
    values = list(values)
    if not values or any(math.isnan(v) for v in values):  # statistics.stdev raises on nan
        return (fmean(values) if values else math.nan), math.nan
    return fmean(values), (stdev(values) if len(values) > 1 else 0.0)


def target_stats(histories: Iterable[History], target: float | None) -> dict:
    """Rounds to ``target`` over repeats: ``rounds_to_target`` (the mean over the runs that
    reached it, nan when none did), ``rounds_to_target_std`` (their sample standard deviation),
    ``reached`` (how many did) and ``runs``."""
    histories = list(histories)
    if target is None:
        return {
            "target": None,
            "rounds_to_target": None,
            "rounds_to_target_std": None,
            "reached": None,
            "runs": len(histories),
        }
    reached = [r for r in (rounds_to_target(h, target) for h in histories) if r is not None]
    mean, sd = mean_and_sd(reached)
    return {
        "target": target,
        "rounds_to_target": mean,
        "rounds_to_target_std": sd,
        "reached": len(reached),
        "runs": len(histories),
    }


def format_rounds_to_target(stats: dict) -> str:
    """``"22.3 ± 1.5 (3/3)"`` over repeats (the spread once two runs reached the target, the count
    always), ``"22"`` or ``"not reached"`` for a single run."""
    if stats["runs"] == 1:
        return "not reached" if not stats["reached"] else f"{stats['rounds_to_target']:.0f}"
    count = f"({stats['reached']}/{stats['runs']})"
    if not stats["reached"]:
        return f"– {count}"
    spread = f" ± {stats['rounds_to_target_std']:.1f}" if stats["reached"] > 1 else ""
    return f"{stats['rounds_to_target']:.1f}{spread} {count}"


def check_target(target: float | None, spelled: str = "target") -> float | None:
    """A target test accuracy: a fraction in (0, 1], or None; else a ConfigError naming ``spelled``."""
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= 1):
        raise ConfigError(f"{spelled}: must be a test accuracy, a fraction in (0, 1], got {target!r}")
    return target


def _yaml_mapping(text: str):
    import yaml

    try:
        return parse_yaml(text)
    except yaml.YAMLError as e:
        raise ValueError(" ".join(str(e).split())) from None
