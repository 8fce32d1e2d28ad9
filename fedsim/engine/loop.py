"""The round: plan -> train -> collect -> update -> evaluate.

All randomness is a function of (seed, round, client) (see streams.py): the client sample of a
round and who is online, fails or straggles in it (see system.py), each client's shuffling and
dropout, the attack noise. A run therefore gives the same numbers whatever executes the
clients, and a resumed run continues exactly where it stopped. The loop knows no particular
algorithm, rule or attack (it calls their interfaces), and no particular way of running
clients (an ``Executor``) or of updating the global model (an update strategy, update.py).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from ..core.errors import user_code
from ..core.flat import FlatModel
from ..core.streams import eval_subset_rng
from ..core.threads import scoring_threads
from ..experiment.components import describe
from ..experiment.config import Config
from ..fl.system import RoundPlan, System
from ..models import tasks
from ..models.lora import merged_adapters
from ..results.records import ClientRecord, RoundRow
from .buffers import RoundBuffers
from .state import GlobalState

if TYPE_CHECKING:
    from ..fl.client_eval import ClientEvaluation
    from ..fl.privacy import Privacy


class Executor(Protocol):
    """Trains a round's clients into the round's buffers: rows 0..k-1 hold the clients'
    weights, stats and reports afterwards. The engine calls ``start``, ``agree`` and ``train``;
    the session calls the rest around the rounds. The bodies here are those of an executor in one
    process, which has no other part of the run to talk to (a subclass inherits them); several
    ranks override them (execution/ranks.py)."""

    busy_seconds: list[float]  # each worker's training time in the last round
    peak_memory: list[int]  # bytes, each worker's peak
    # bytes: each worker's proportional set size and the server's, read at one moment (read_pss),
    # the one their sum was highest at (0 unknown)
    pss_memory: list[int]
    server_pss: int

    def start(self, buffers: RoundBuffers) -> None:
        """Take the run's buffers; workers are ready when this returns."""

    def train(self, rnd: int, clients: torch.Tensor, start_from: torch.Tensor) -> None:
        """Train ``clients`` (slot by slot) from ``start_from`` into the buffers' rows."""

    def read_pss(self) -> None:
        """Read every process's proportional set size now, at one moment, between rounds; keep
        the reading whose sum is the highest so far in ``pss_memory`` and ``server_pss``."""

    def agree(self, compute: Callable[[], object]) -> object:
        """``compute()``, computed once and the same for every part of the run that plans rounds."""
        return compute()

    def share_start(self, first_round: int) -> int:
        """The round every part of the run starts from (a resumed run's is read by the leader)."""
        return first_round

    def end_round(self, rnd: int, trained: torch.Tensor, go_on: bool) -> None:
        """After the leader has recorded round ``rnd``: the other parts of the run, if any, learn
        whether to go on and take the new global state."""

    def follow(self, engine: Engine, first_round: int) -> None:
        """The rounds of a part of the run that does not lead (a rank other than 0)."""
        raise NotImplementedError("only a run over several ranks has parts that follow the leader")

    def close(self, finished: bool = True, ended_by: BaseException | None = None) -> None:
        """Stop the workers. ``finished``: every round was done; ``ended_by``: what ended the run
        otherwise (an exception, a signal)."""


@dataclass
class RoundResult:
    row: dict  # the round's RoundRow, as a dict (test_accuracy is NaN when the round is not evaluated)
    clients: list[ClientRecord]  # the trained clients slot by slot, then those whose work was lost
    evaluated: bool
    trained: torch.Tensor  # the ids of the clients trained, slot by slot


@torch.inference_mode()
def evaluate(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> tuple[float, float]:
    """Accuracy and mean loss over the scored targets (a sample's label, or a sequence's tokens);
    one host sync at the end. The data may live in host memory (data.placement): each batch then
    goes to the model's device."""
    module.eval()
    device = next(module.parameters()).device
    correct = torch.zeros((), dtype=torch.int64, device=device)
    targets = torch.zeros((), dtype=torch.int64, device=device)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    with merged_adapters(module):  # LoRA adapters folded into their layers' weights: scoring runs at the base's cost
        for xb, yb in zip(x.split(batch_size), y.split(batch_size)):
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            out = module(xb)
            loss += tasks.loss(out, yb, reduction="sum").double()
            correct += tasks.hits(out, yb).sum()
            targets += tasks.scored(yb).sum()
    return correct.item() / targets.item(), loss.item() / targets.item()


def test_subset(
    test: tuple[torch.Tensor, torch.Tensor], size: int | None, seed: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``size`` test samples drawn by the seed (in test-set order), the same every round and
    whatever the workers; None when there is no subset to draw (``size`` null or the whole set).
    Quick runs score their rounds on it; the last round is scored on the whole test set."""
    x, y = test
    if size is None or size >= len(y):
        return None
    kept = torch.from_numpy(np.sort(eval_subset_rng(seed).choice(len(y), size, replace=False))).to(y.device)
    return x[kept], y[kept]


class Engine:
    """One run's rounds. ``test`` is the (inputs, labels) of the test set; ``client_eval``
    scores the global model on every client's test split (or None); ``privacy`` reports the
    privacy spent (or None)."""

    def __init__(
        self,
        cfg: Config,
        state: GlobalState,
        buffers: RoundBuffers,
        executor: Executor,
        strategy: Any,
        system: System,
        test: tuple[torch.Tensor, torch.Tensor],
        client_eval: ClientEvaluation | None = None,
        privacy: Privacy | None = None,
    ):
        self.cfg, self.state, self.buffers, self.executor, self.strategy = cfg, state, buffers, executor, strategy
        self.system, self.test, self.client_eval, self.privacy = system, test, client_eval, privacy
        self.test_subset = test_subset(test, cfg.eval_subset, cfg.seed)  # the rounds' before the last, or None
        self.sizes = np.diff(buffers.client_offsets.numpy())  # the clients' sample counts
        self.personal_model: FlatModel | None = None  # where eval_per_client loads each client's own model

    def run_round(self, rnd: int) -> RoundResult:
        t0 = time.perf_counter()
        # 1. the round's clients among the online ones: those whose work reaches the server are
        #    trained, partial stragglers for fewer steps
        plan = self.plan(rnd)
        clients = torch.from_numpy(plan.clients)
        # 2. train them from the global weights, their own state in the round's rows
        for name, rows in self.state.client_rows(plan.clients.tolist()).items():
            self.buffers.client_state[name][: len(rows)].copy_(rows)
        self.executor.train(rnd, clients, self.state.model.flat)
        t_trained = time.perf_counter()
        # 3. their updates as the server sees them, and one record per sampled client
        round_, records = self.strategy.collect(rnd, clients)
        records += [
            ClientRecord.lost(
                rnd, c, int(self.sizes[c]), plan.outcome(c), int(self.buffers.attackers[c]), model_version=rnd - 1
            )
            for c in plan.dropped.tolist()
        ]
        clip = self.privacy.current_clip if self.privacy else None  # this round's, before adaptive clipping moves it
        # 4. the new global state (under privacy also from no client: the noise is released)
        if len(round_.clients) or self.privacy:
            self.strategy.update(rnd, round_)
        t_updated = time.perf_counter()
        # 5. evaluate (with eval_per_client, also on every client's test split)
        evaluated, scores = self.evaluate_round(rnd)
        if self.state.simulated_time is not None:
            self.state.simulated_time += plan.simulated_seconds
        row = RoundRow(
            round=rnd,
            **scores,
            **self._train_metrics(round_, records),
            seconds=round(time.perf_counter() - t0, 4),
            clients=len(records),
            attackers=sum(r.attacker for r in records) + round_.byzantine + round_.byzantine_left_out,
            train_seconds=round(t_trained - t0, 4),
            worker_seconds=round(max(self.executor.busy_seconds), 4),
            aggregate_seconds=round(t_updated - t_trained, 4),
            eval_seconds=round(time.perf_counter() - t_updated, 4),
            epsilon=self.privacy.epsilon(rnd) if self.privacy else None,
            clip=clip,
            **self._traffic(plan),
            # dropped_clients: the lost work of the plan, and the non-finite updates left out
            **plan.metrics(left_out=len(plan.clients) - len(round_.clients) + round_.byzantine_left_out),
            simulated_time=self.state.simulated_time,
            **self.state.algorithm.round_figures(self.state.server_state),
        )
        return RoundResult(row.as_row(), records, evaluated, clients)

    def plan(self, rnd: int) -> RoundPlan:
        """The round's plan (see system.py), its step limits written where the workers read them."""
        cfg = self.cfg
        if self.system.needs_losses:
            with user_code(f"model {describe(cfg.model)} failed on the candidates' data in round {rnd}"):
                losses = self.executor.agree(lambda: self._candidate_losses(rnd))
        else:
            losses = None
        plan = self.system.round(cfg.seed, rnd, cfg.data.num_clients, cfg.clients_per_round, self.sizes, losses)
        limits = [-1 if limit is None else limit for limit in plan.step_limits]
        self.buffers.step_limits[: len(limits)] = torch.tensor(limits, dtype=torch.int64)
        self.buffers.slot_keys[: len(limits)] = rnd
        return plan

    def _traffic(self, plan: RoundPlan) -> dict:
        """The round's bytes: the global weights go to every client sampled (to every candidate under
        power_of_choice, which each sends back its loss as a float32), and every client that
        reports sends its message; the dropouts' and late clients' uploads never arrive. Nothing
        travels where the strategy sends no messages (None)."""
        sizes = self.strategy.message_bytes()
        if sizes is None:
            return {}
        polled = len(plan.candidates) if len(plan.candidates) > len(plan.sampled) else 0
        down, up = len(plan.candidates) * sizes[0], len(plan.clients) * sizes[1] + 4 * polled
        if self.state.bytes_sent is not None:
            self.state.bytes_sent += down + up
        return {"bytes_down": down, "bytes_up": up, "cumulative_bytes": self.state.bytes_sent}

    def _candidate_losses(self, rnd: int) -> dict[int, float] | None:
        """power_of_choice: the current global model's mean loss on each candidate's whole training
        set, computed in the server process in eval mode (no dropout, no augmentation), so the
        same whatever the workers; None when there are no more candidates than clients to keep."""
        cfg, b = self.cfg, self.buffers
        candidates = self.system.candidates(cfg.seed, rnd, cfg.data.num_clients, cfg.clients_per_round, self.sizes)
        if len(candidates) <= cfg.clients_per_round:
            return None
        losses = {}
        with scoring_threads():
            for c in candidates.tolist():
                ix = b.client_samples(c)
                losses[c] = evaluate(self.state.model.module, b.train_x[ix], b.train_y[ix], cfg.eval_batch_size)[1]
        return losses

    def evaluation_note(self) -> str | None:
        """The header's line on what the rounds are scored on, where it is not the whole test set."""
        if self.test_subset is None:
            return None
        return (
            f"rounds before the last are scored on {len(self.test_subset[1]):,} of the {len(self.test[1]):,} test "
            f"samples (eval_subset, the same every round); round {self.cfg.rounds} on all of them"
            + (", as is a round that reaches stop_at_accuracy on the subset" if self.cfg.stop_at_accuracy else "")
        )

    def subset_hint(self, row: dict) -> str | None:
        """Where scoring the whole test set took longer than training (and a second or more) in
        evaluated round ``row`` and rounds before the last are still to be scored, a line that
        offers eval_subset, sized so that scoring would take about as long as training; else None."""
        cfg, scoring, training = self.cfg, row["eval_seconds"], row["train_seconds"]
        if cfg.eval_subset is not None or row["test_samples"] is None or scoring <= max(training, 1.0):
            return None
        if row["round"] + cfg.eval_every >= cfg.rounds:
            return None  # no round before the last left to score
        size = max(1, int(float(f"{row['test_samples'] * training / scoring:.2g}")))
        return (
            f"scoring all {row['test_samples']:,} test samples took {scoring:.1f} s of round {row['round']}, training "
            f"{training:.1f} s: --set eval_subset={size} scores the rounds before the last on {size:,} samples drawn "
            f"by the seed (the last round on all)"
        )

    def reaches(self, row: dict, target: float | None) -> bool:
        """Whether the round of ``row`` reaches stop_at_accuracy ``target`` (never where its test
        accuracy is NaN). One that does on eval_subset is scored again on the whole test set, as a
        last round is, and ``row`` updated: the run stops, and rounds_to_target counts, only on
        that score."""
        if target is None or not row["test_accuracy"] >= target:
            return False
        if self.test_subset is not None and row["round"] < self.cfg.rounds:
            row.update(self.scores(full=True))
        return row["test_accuracy"] >= target

    def initial_row(self) -> dict:
        """Round 0: the model the run starts from (``initial_weights``), scored on the whole test set
        before any client trains, so that a fine-tuning run's gain over its base is in its rows."""
        t0 = time.perf_counter()
        with user_code(f"model {describe(self.cfg.model)} failed in the evaluation of round 0"):
            scores = self.scores(full=True)
        seconds = round(time.perf_counter() - t0, 4)
        zero = dict.fromkeys(("clients", "dropped_clients", "attackers", "unavailable", "stragglers"), 0)
        times = dict.fromkeys(("train_seconds", "worker_seconds", "aggregate_seconds"), 0.0)
        sent = {} if self.state.bytes_sent is None else {"bytes_down": 0, "bytes_up": 0, "cumulative_bytes": 0}
        row = RoundRow(
            round=0,
            **scores,
            train_loss=math.nan,
            seconds=seconds,
            eval_seconds=seconds,
            **zero,
            **times,
            **sent,
            simulated_time=self.state.simulated_time,
        )
        return row.as_row()

    def evaluate_round(self, rnd: int) -> tuple[bool, dict]:
        """Whether round ``rnd`` is evaluated (every eval_every-th and the last), and its scores."""
        evaluated = rnd % self.cfg.eval_every == 0 or rnd == self.cfg.rounds
        with user_code(f"model {describe(self.cfg.model)} failed in the evaluation of round {rnd}"):
            return evaluated, self._evaluate(rnd, evaluated)

    def _evaluate(self, rnd: int, evaluated: bool) -> dict:
        cfg, module = self.cfg, self.state.model.module
        if not evaluated:
            return {"test_accuracy": math.nan, "test_loss": math.nan}
        scores = self.scores(full=rnd == cfg.rounds)
        with scoring_threads():  # as scores() has
            if not self.client_eval:
                per_client = {}
            elif not self.state.algorithm.has_personal_model:
                per_client = self.client_eval.score(module, *self.test, cfg.eval_batch_size, rnd)
            else:  # every client's own model, in a copy of the global one
                personal = self.personal_model or FlatModel(copy.deepcopy(module), self.state.model.flat.device)
                self.personal_model = personal
                per_client = self.client_eval.score_personal(
                    personal,
                    self.state.algorithm.personal_scorer(personal.module, self.state.server_state),
                    self.state.personal_weights_of,
                    *self.test,
                    cfg.eval_batch_size,
                    rnd,
                    self.state.trained_clients(),
                )
        return {**scores, **per_client}

    def scores(self, full: bool) -> dict:
        """The global model's test accuracy and loss (and perplexity, for tokens): on the whole
        test set where ``full`` or no eval_subset is set, else on the subset."""
        scored = self.test if full or self.test_subset is None else self.test_subset
        with scoring_threads():
            accuracy, loss = evaluate(self.state.model.module, *scored, self.cfg.eval_batch_size)
        perplexity = {"test_perplexity": tasks.perplexity(loss)} if self.test[1].ndim == 2 else {}
        return {"test_accuracy": accuracy, "test_loss": loss, **perplexity, "test_samples": len(scored[1])}

    def _train_metrics(self, round_, records: list[ClientRecord]) -> dict:
        """The mean training loss over the kept clients' samples, as each client's loss is the mean
        over its own; ``records`` starts with the trained clients, slot by slot."""
        if not len(round_.clients):
            return {"train_loss": math.nan}
        losses = self.buffers.stats[:, 1][[i for i, r in enumerate(records) if not r.dropped]]
        weights = round_.weights[: len(round_.clients)]  # not the Byzantine clients' outside the federation
        return {"train_loss": float((weights * losses).sum() / weights.sum())}
