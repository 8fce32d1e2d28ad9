"""The algorithm interface: everything a federated algorithm adds to plain local SGD, in one class.

An algorithm declares the state it keeps and what its clients report; the engine allocates
those tensors once, shares them with the worker processes and puts them in every checkpoint.
Its methods receive the state as arguments (they keep none of their own), so one algorithm
object serves the server and every worker alike:

    on a worker, for each client (or vmap group of c clients):
        local = start_client(clients)                            once, before the first step
        trained = train_client(fit, start, local)                local SGD: fit(start) by default
        adjust_gradient(grad, weights, start, local)             every step, before momentum
        reports = client_report(result, local)                  once, after the last step
    on the server, after the round:
        delta = server_update(round, server_state, client_rows)

Client-side tensors have a leading client dimension (1 for the process backend, the group's
size for vmap). Workers only read the state; the server changes it, after the round, in
``server_update``: a round that is re-run after a worker failure therefore changes nothing twice.

A client's state (``client_state``) lives in host memory with the rest of what clients keep
(client_state.py); the round's rows reach the workers as ``Clients.state`` and the server's
update as ``client_rows``, whose changes are kept. A personal model is such a state: the client
trains it itself and keeps it (``personal_state``: the report of that name is its new value, and
never travels to the server), ``personal_weights`` says which weights the client uses, and
``eval_per_client`` scores those.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..core.flat import FlatModel


@dataclass
class Clients:
    """The clients a worker is about to train: one, or a vmap group of c."""

    ids: torch.Tensor  # [c] client ids
    round: int
    server: dict[str, torch.Tensor]  # the server state (read only)
    state: dict[str, torch.Tensor]  # these clients' rows of the client state, [c, ...] (copies)


@dataclass
class LocalResult:
    """What local training produced, for ``client_report``."""

    start: torch.Tensor  # [L] the global weights the clients started from
    weights: torch.Tensor  # [c, L] their weights after training, as the server will read them
    steps: torch.Tensor  # [c] SGD steps each took
    samples: torch.Tensor  # [c] training samples each holds
    mean_gradient: torch.Tensor | None  # [c, n] mean raw minibatch gradient, if keeps_mean_gradient


@dataclass
class Round:
    """One round as the server sees it, for ``server_update``. Rows are the clients whose update
    was finite (dropped ones are left out), after any attack rewrote them, then those of the
    Byzantine clients outside the federation (``byzantine``)."""

    updates: torch.Tensor  # [k, L] client weights minus global weights
    weights: torch.Tensor  # [k] the clients' sample counts
    clients: torch.Tensor  # [k] client ids, on the device of the state
    reports: dict[str, torch.Tensor]  # name -> [k, ...], as declared by report_shapes
    aggregate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # the run's aggregation rule
    global_weights: torch.Tensor  # [L] the weights the round started from (read only)
    num_params: int  # n: weights[:n] are trainable, the rest are buffers (batch-norm statistics)
    num_clients: int  # N, the whole federation
    slots: torch.Tensor | None = None  # [k] the rows of the round's buffers these clients were trained in
    # the last ``byzantine`` rows of ``updates`` and ``weights`` are those of the Byzantine clients outside
    # the federation (attack.count): they have no client id, report or slot, so ``clients``, ``reports`` and
    # ``slots`` hold the first k - byzantine rows only
    byzantine: int = 0
    byzantine_left_out: int = 0  # those whose update was non-finite, left out as a client's is (on_nonfinite: drop)
    number: int = 0  # the round's number (1 for the first)


class Algorithm:
    """Plain FedAvg: local SGD from the global weights, the aggregation rule's update applied.

    Subclass it and override what your algorithm changes. Options are the constructor's
    keyword arguments, set from ``algorithm_options`` in an experiment file.
    """

    keeps_mean_gradient = False  # set True to get LocalResult.mean_gradient (costs a [n] sum per step)
    sent_to_clients: tuple[str, ...] = ()  # the server state its clients read: it travels with the global weights
    # False: clients neither receive the global weights nor send theirs, only reports and the server
    # state they read travel (FedProto's prototypes); what the traffic counts (bytes_sent)
    exchanges_weights = True
    # the aggregation rule the algorithm's paper fixes: a run that sets no aggregator gets it, one
    # that sets another is warned (None: the paper fixes none, and such a run gets fedavg)
    paper_aggregator: str | None = None
    # client states each client updates itself: its report of that name is its new row, kept on the
    # client in a deployment (no traffic), committed before server_update sees the rows
    personal_state: tuple[str, ...] = ()
    # config keys that only the algorithms declaring them read (lora.client_ranks): a run of another
    # algorithm that sets one is told that nothing reads it
    reads: tuple[str, ...] = ()
    # reports, each of shape (1,) and a whole number, that clients.csv records in a column of that name
    # after the columns every run has (a client's LoRA rank, say)
    recorded_reports: tuple[str, ...] = ()
    # reports the server knows already, having set them itself (CFL's cluster): recorded, but no
    # traffic, as a deployment's client would not send them
    echoed_reports: tuple[str, ...] = ()

    def kept_locally(self) -> torch.Tensor | None:
        """[m] bool over the first m of the flat weights: those each client keeps to itself and that
        travel neither way (FedPer's head), left out of the traffic counted; None: there are none."""
        return None

    def setup(self, config: Any) -> None:
        """Called once in the server and once in every worker with the run's Config, before any
        other method: the place to read settings such as ``config.local.momentum``."""
        self.config = config

    def bind(self, module: torch.nn.Module) -> None:
        """Called with the run's model (in the server and in every worker) after ``setup``: the
        place to find the layers an algorithm treats apart. Raise ConfigError for bad options."""

    # ----------------------------------------------------------------- state

    def server_state(self, num_params: int) -> dict[str, tuple[int, ...]]:
        """Tensors the server keeps, by name and shape; zeros at the start, unless ``start_server``
        fills them."""
        return {}

    def start_server(self, server: dict[str, torch.Tensor], model: FlatModel) -> None:
        """Called once in the server before round 1 (a resumed run's checkpoint then replaces the
        state): the place to fill ``server`` with what is not zero at the start, from the run's
        initial model (IFCA's k cluster models)."""

    def client_state(self, num_params: int) -> dict[str, tuple[int, ...]]:
        """Tensors kept for every client, by name and the shape of one client's row, in host
        memory; a client starts from ``new_client_state``."""
        return {}

    def new_client_state(self, global_weights: torch.Tensor, num_params: int) -> dict[str, torch.Tensor]:
        """The rows of a client that has none yet (before its first round), from the global weights
        ([P], of which the first ``num_params`` are trainable) as they are then: zeros by default."""
        return {name: global_weights.new_zeros(shape) for name, shape in self.client_state(num_params).items()}

    def personal_weights(
        self, global_weights: torch.Tensor, rows: dict[str, torch.Tensor], server: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """The weights ([P]) a client with state ``rows`` uses as its own model, given the server
        state ``server`` (a clustered algorithm's cluster models); None: it uses the global model
        (no personal model)."""
        return None

    def personal_scorer(self, module: torch.nn.Module, server: dict[str, torch.Tensor]) -> torch.nn.Module:
        """What ``eval_per_client`` scores a client's own model with: ``module``, holding the client's
        ``personal_weights``, or a module around it whose scores' argmax is the prediction (FedProto's
        nearest prototype), given the server state ``server``."""
        return module

    def report_shapes(self, num_params: int) -> dict[str, tuple[int, ...]]:
        """What a client reports besides its weights, by name and shape."""
        return {}

    # ----------------------------------------------------------------- a client (in a worker)

    def train_client(self, fit: Callable[..., Any], start: torch.Tensor, local: Any) -> Any:
        """A client's local training. ``fit(start, epochs=None, trainable=None, term=None,
        objective=None)`` runs local SGD from the weights ``start`` ([P]) for ``epochs`` (None:
        local.epochs), changing only the coordinates where the [n] mask ``trainable`` is 1 (None:
        all), with the gradient term ``term(grad, weights)`` (None: ``adjust_gradient``), on the
        minibatch loss ``objective(module, x, y)`` (None: the task's cross-entropy of ``module(x)``;
        an algorithm that adds a term to the loss, or reads the model's representation, computes
        it there), and returns what it did (its
        ``weights`` [P]: the trainer's own, changed by the next fit). What the last fit leaves in
        ``weights`` is what the client sends; return the fit that counts as the client's training.
        ``fit.loss(weights)`` is the client's mean loss on its training samples at ``weights`` ([P]),
        in eval mode (IFCA's choice of a cluster). Only the process backend runs an algorithm that
        overrides this."""
        return fit(start)

    def phase_epochs(self, epochs: int) -> tuple[int, ...]:
        """The epochs of each ``fit`` that ``train_client`` runs, in the order it runs them, given
        local.epochs: one phase of ``epochs`` by default. The simulated clock (fl/system.py) charges
        every phase's steps and spends a straggler's step budget on the phases in this order, so an
        algorithm that trains in several phases declares them here."""
        return (int(epochs),)

    def phase_steps(self, steps: int | None) -> tuple[int | None, ...]:
        """The most steps of each phase of ``phase_epochs``, given local.steps (None: no cap, the
        phase's epochs): local.steps caps each phase on its own, so that an earlier phase never
        spends the steps of the one whose weights the client sends; an algorithm overrides this to
        give a phase a cap of its own. The clock and the workers both read this."""
        return (steps,) * len(self.phase_epochs(1))

    def start_client(self, clients: Clients) -> Any:
        """Before the first step. What is returned comes back as ``local`` in the two methods
        below (a correction to add at every step, say)."""
        return None

    def adjust_gradient(self, grad: torch.Tensor, weights: torch.Tensor, start: torch.Tensor, local: Any) -> None:
        """Add the algorithm's term to ``grad`` ([c, n], in place) at weights ``weights`` ([c, n])
        of clients that started from ``start`` ([n]; [c, n] in an async run, where each client
        started from a model of its own); weight decay is already in ``grad``."""

    def client_report(self, result: LocalResult, local: Any) -> dict[str, torch.Tensor]:
        """After the last step: the reports, each ``[c, *shape]``."""
        return {}

    # ----------------------------------------------------------------- the server

    def server_update(
        self, round: Round, server: dict[str, torch.Tensor], clients: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """The update Δ ([L]) of the global weights, which the server optimizer then applies (the
        global weights become x + Δ without one). Change the state here, in place: ``server`` the
        server's, ``clients`` the rows ([k, ...]) of the round's clients, ``round.clients``."""
        return round.aggregate(round.updates, round.weights)

    def aggregation(self, rule: str) -> str:
        """How the server combines the clients' updates, in words for the header, summary.json
        (``aggregation``) and tables, given the run's rule (``aggregator``, named): the rule, unless
        the algorithm replaces it or changes what it weighs."""
        return rule

    def round_figures(self, server: dict[str, torch.Tensor]) -> dict[str, int | float]:
        """metrics.csv's figures of the algorithm after a round, from the server state: columns of
        results/records.py's RoundRow (a clustered algorithm's ``clusters``); none by default."""
        return {}

    def summary(self, client_rows: list[dict]) -> dict:
        """summary.json's figures of the algorithm, from the run's clients.csv rows (as dicts, with the
        ``recorded_reports``): none by default."""
        return {}

    def resume(self, server: dict[str, torch.Tensor]) -> None:
        """Called in the server once a checkpoint has restored the server state ``server``: the
        place to rebuild what the state stands for outside it (FLoRA's merges into the base)."""

    @property
    def has_personal_model(self) -> bool:
        return type(self).personal_weights is not Algorithm.personal_weights

    @property
    def needs_only_weights(self) -> bool:
        """Whether the server needs nothing of a client but its trained weights: no server or
        client state, no reports, the rule's update (what an async run can apply, one by one)."""
        return (
            type(self).server_update is Algorithm.server_update
            and not self.server_state(1)
            and not self.client_state(1)
            and not self.report_shapes(1)
            and not self.has_personal_model
        )

    @property
    def trains_own_way(self) -> bool:
        return type(self).train_client is not Algorithm.train_client

    @property
    def has_gradient_term(self) -> bool:
        return type(self).adjust_gradient is not Algorithm.adjust_gradient
