"""What a run records: one row per round (the schema of ``metrics.csv``) and one record per
sampled client and round (the schema of ``clients.csv``). Both engines build these, so a column
is added here once. This module imports nothing heavy: the run directory reads its columns."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields


@dataclass(kw_only=True)
class RoundRow:
    """One round of the run. Columns of a feature the run does not use are None (empty cells)."""

    round: int
    test_accuracy: float  # NaN where the round is not evaluated
    test_loss: float  # the mean over the scored targets: samples, or a text task's tokens
    train_loss: float  # the mean over the kept clients' samples (NaN where no client's work counted)
    seconds: float  # the round's wall time; its parts are train_, aggregate_ and eval_seconds
    elapsed_seconds: float | None = None  # since the run began (a resumed run's from its first start)
    clients: int  # sampled (an async server update: whose work arrived, used or not)
    dropped_clients: int  # whose work did not count: lost, or left out as non-finite
    attackers: int
    train_seconds: float
    worker_seconds: float  # the busiest worker's training time
    aggregate_seconds: float
    eval_seconds: float
    epsilon: float | None = None  # privacy spent so far (privacy)
    clip: float | None = None  # this round's clip bound (privacy)
    client_accuracy_mean: float | None = None  # over the clients' own test splits (eval_per_client)
    client_accuracy_std: float | None = None
    client_accuracy_p10: float | None = None
    simulated_seconds: float | None = None  # this round on the simulated clock
    simulated_time: float | None = None  # the clock since round 1 (None where nothing keeps it)
    unavailable: int
    stragglers: int
    bytes_down: int | None = None  # None where nothing travels (hogwild)
    bytes_up: int | None = None
    cumulative_bytes: int | None = None
    test_perplexity: float | None = None  # exp(test_loss), for a token-level task (a language model)
    test_samples: int | None = None  # the test samples scored: eval_subset's or the whole set's (None: not evaluated)
    clusters: int | None = None  # a clustered algorithm's (ifca, cfl): the clusters holding a client after the round

    def as_row(self) -> dict:
        return asdict(self)


METRIC_COLUMNS = tuple(f.name for f in fields(RoundRow))


@dataclass
class ClientRecord:
    round: int
    client: int
    samples: int
    train_loss: float  # the mean loss of its local training (NaN where its work was lost)
    update_norm: float  # ||client weights - global weights|| (NaN where there is no update of its own)
    dropped: int | str  # 0, or why its work did not count: nonfinite, dropout, straggler
    attacker: int
    steps: int  # local steps taken: fewer than its full work for a partial straggler, 0 where lost
    model_version: int | None = None  # the server updates applied before it started: the model it trained
    staleness: int | None = None  # the server updates applied while it trained (None where its work was lost)
    # the reports the run's algorithm records in clients.csv (Algorithm.recorded_reports), by name: whole numbers
    reports: dict[str, int] = field(default_factory=dict)

    def as_row(self) -> dict:
        row = dict(vars(self))
        reports = row.pop("reports")
        return {**row, **reports}

    @classmethod
    def lost(
        cls, rnd: int, client: int, samples: int, why: str, attacker: int, model_version: int | None = None
    ) -> ClientRecord:
        """A sampled client whose work never reached the server: no loss, no update, no steps."""
        return cls(rnd, client, samples, math.nan, math.nan, why, attacker, 0, model_version)


# the client's own id in the data (a LEAF writer, a play role), where it has one, beside its number; the
# algorithm's recorded reports follow these (client_columns)
CLIENT_COLUMNS = (
    "round",
    "client",
    "client_name",
    *(f.name for f in fields(ClientRecord) if f.name not in ("round", "client", "reports")),
)


def client_columns(recorded: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The columns of a run's clients.csv: every run's, then the reports its algorithm records."""
    return (*CLIENT_COLUMNS, *recorded)
