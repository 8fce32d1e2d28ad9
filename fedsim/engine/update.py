"""How a round's training becomes the new global model: an update strategy collects what the
clients left in the round's buffers (one record per client, and the updates as the server sees
them) and turns it into the new global state.

``AggregateUpdates`` is the synchronous FedAvg family: every client trained a copy of the
global weights; their differences from the global weights (after an attack rewrote the
attackers', each client compressed what it sends, and non-finite ones were left out) go through
the algorithm's server update, with the run's rule (or privacy's clipped, noised mean), then
through the server optimizer.
A strategy whose clients train the global weights themselves adopts them instead (see
``AdoptSharedWeights`` in the execution package).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from ..algorithms import Algorithm, Round
from ..core.blocks import all_finite, finite_rows, row_norms
from ..core.errors import NonFiniteError, UserCodeError, user_code
from ..core.streams import attack_generator, pre_aggregation_generator
from ..fl.aggregation import (
    Memory,
    PreAggregator,
    Rule,
    TooFewUpdates,
    equivariant,
    expanding,
    is_equivariant,
    is_expanding,
    remembers,
)
from ..fl.aggregation.preaggregation import pre_aggregated
from ..fl.attacks import Attack, RoundView
from ..results.records import ClientRecord
from .buffers import RoundBuffers
from .state import GlobalState

if TYPE_CHECKING:
    from ..experiment.config import Config
    from ..fl.compression import Compression
    from ..fl.privacy import Privacy

logger = logging.getLogger("fedsim")


def check_finite(state: GlobalState, tensor: torch.Tensor, rnd: int, what: str, why: str, advice: str) -> None:
    """The global state must stay finite: stop before a non-finite one is evaluated or saved."""
    if not all_finite(tensor):
        raise NonFiniteError(
            f"round {rnd}: {what} (NaN/Inf){why}; nothing of this round was saved and {state.kept()}; {advice}"
        )


def stop_on_nonfinite(
    cfg: Config,
    state: GlobalState,
    rnd: int,
    client: int,
    in_a_row: int,
    at_once: int,
    what: str,
    advice: str = "lower local.lr, or check the model's output",
) -> None:
    """The rule for non-finite (NaN/Inf) client updates, the same in every engine: such an update
    never reaches the global model. ``on_nonfinite: fail`` stops the run at the first (``client``'s);
    ``drop`` leaves it out, and stops the run once ``in_a_row`` of them have come with no usable
    update among them (clients that dropped out send none) and as many as train at once
    (``at_once``: a synchronous round's clients, an async run's ``clients_per_round``). Until a
    usable update comes the global model cannot change, so the clients that train it next would
    send more of the same: a server that waited for a usable one could wait forever. ``what``
    names the updates in the message."""
    if cfg.on_nonfinite == "fail":
        raise NonFiniteError(
            f"round {rnd}: client {client} sent non-finite (NaN/Inf) weights "
            f"(on_nonfinite: fail; use drop to leave such clients out)"
        )
    if in_a_row >= at_once:
        raise NonFiniteError(
            f"round {rnd}: {what} non-finite (NaN/Inf); nothing of this round was saved and {state.kept()}; {advice}"
        )


# a weight past this, the square root of float32's largest, makes a model's products overflow: no
# learning rate sets one there, an aggregate does
_BLOWN_UP = 1.8e19


def update_sizes(state: GlobalState, compression: Compression | None) -> tuple[int, int]:
    """A client's update in bytes, whole and as it is sent. The layers a client keeps to itself
    (``Algorithm.kept_locally``) travel neither way; only the trainable parameters' part is
    compressed, the whole of it as the compressor is given it (zero where the client keeps its own);
    buffers travel whole; float32 unless compressed."""
    n, length, size = state.model.num_params, len(state.model), state.model.flat.element_size()
    kept = state.algorithm.kept_locally()
    kept_trained, kept_buffers = (0, 0) if kept is None else (int(kept[:n].sum()), int(kept[n:].sum()))
    whole = size * (length - kept_trained - kept_buffers)
    if not compression:
        return whole, whole
    return whole, compression.compressor.message_bytes(n) + size * (length - n - kept_buffers)


def warn_dropped(rnd: int, clients: list[int]) -> None:
    """The warning of ``on_nonfinite: drop`` for the non-finite updates a round left out."""
    if clients:
        logger.warning(f"round {rnd}: dropped {len(clients)} client(s) with non-finite weights: {clients}")


class AggregateUpdates:
    """``names`` describes the algorithm, rule and server optimizer for error messages."""

    def __init__(
        self,
        cfg: Config,
        state: GlobalState,
        buffers: RoundBuffers,
        algorithm: Algorithm,
        aggregate: Rule,
        privacy: Privacy | None,
        attack: Attack,
        names: dict,
        compression: Compression | None = None,
        pre_aggregators: list[PreAggregator] | None = None,
    ):
        self.cfg, self.state, self.buffers = cfg, state, buffers
        self.algorithm, self.aggregate, self.privacy, self.attack, self.names = (
            algorithm,
            aggregate,
            privacy,
            attack,
            names,
        )
        self.compression = compression  # compression.Compression, or None: updates travel whole
        self.pre_aggregators = pre_aggregators or []
        self._warned_breakdown = self._warned_too_few = self._warned_outsiders = False
        if remembers(aggregate):  # what it remembers before round 1; a resume then replaces it
            state.aggregator_state = aggregate.start_memory(state.model.flat)
        self._memory: Memory | None = None  # what the rule leaves of the round's update, kept with the round

    def message_bytes(self) -> tuple[int, int]:
        """Bytes each client receives (the global weights but the part it keeps to itself, and the
        server state its algorithm reads, float32) and sends (its update as ``update_sizes`` counts
        it, and its reports but the personal states it keeps and those the server set)."""
        state, exchanges = self.state, self.algorithm.exchanges_weights
        whole, sent = update_sizes(state, self.compression) if exchanges else (0, 0)
        read = sum(state.server_state[name].numel() for name in self.algorithm.sent_to_clients)
        down = whole + state.model.flat.element_size() * read
        reports = sum(
            r[0].numel() * r.element_size()
            for name, r in self.buffers.reports.items()
            if name not in (*self.algorithm.personal_state, *self.algorithm.echoed_reports)
        )
        return down, sent + reports

    def collect(self, rnd: int, clients: torch.Tensor) -> tuple[Round, list[ClientRecord]]:
        """The round's updates as the server's update sees them, and one record per client."""
        cfg, b, k = self.cfg, self.buffers, len(clients)
        updates = b.client_weights[:k].sub_(self.state.model.flat)  # client weights - global weights, in place
        attacking = b.attackers[clients]
        byzantine = self._attack(rnd, updates, attacking.to(updates.device))
        finite = finite_rows(updates)
        for report in b.reports.values():
            finite &= finite_rows(report[:k].reshape(k, report[0].numel()))
        if self.compression:  # what each client sends instead (see compression.py for why after the attack)
            self.compression.compress(updates[:, : self.state.model.num_params], clients.tolist(), finite, rnd)
        keep = finite.nonzero().flatten()
        bad = clients[(~finite).cpu()].tolist()
        if bad:  # the round's clients trained at once, from one model: all non-finite is as many in a row
            in_a_row = 0 if len(keep) else len(bad)
            advice = self._advice() if not len(keep) else []
            stop_on_nonfinite(cfg, self.state, rnd, bad[0], in_a_row, k, f"every client's update ({k}) is", *advice)
        warn_dropped(rnd, bad)
        norms, stats = row_norms(updates), b.stats[:k].cpu()
        recorded = {name: b.reports[name][:k, 0].tolist() for name in self.algorithm.recorded_reports}
        records = [
            ClientRecord(
                rnd,
                int(c),
                int(stats[i, 0]),
                float(stats[i, 1]),
                float(norms[i]),
                0 if finite[i] else "nonfinite",
                int(attacking[i]),
                int(stats[i, 2]),
                model_version=rnd - 1,
                staleness=0,
                reports={name: int(values[i]) for name, values in recorded.items()},
            )  # every client trained this round's model
            for i, c in enumerate(clients.tolist())
        ]
        outsiders = len(byzantine.updates)  # their rows after the clients' (none: no second copy of the updates)
        round_ = Round(
            updates=torch.cat([updates[keep], byzantine.updates]) if outsiders else updates[keep],
            weights=torch.cat([b.stats[keep, 0], byzantine.weights]) if outsiders else b.stats[keep, 0],
            clients=clients[keep.cpu()].to(b.global_flat.device),
            reports={name: report[keep] for name, report in b.reports.items()},
            aggregate=self.privacy.rule(cfg.seed, rnd) if self.privacy else self._rule(rnd, keeps_memory=True),
            global_weights=self.state.model.flat,
            num_params=self.state.model.num_params,
            num_clients=cfg.data.num_clients,
            slots=keep,
            byzantine=outsiders,
            byzantine_left_out=byzantine.left_out,
            number=rnd,
        )
        return round_, records

    def _attack(self, rnd: int, updates: torch.Tensor, attacking: torch.Tensor) -> SimpleNamespace:
        """What the round's Byzantine clients send, from what they see of it (the finite updates, their
        own, and the server's own rule): the rows of the attackers among the round's clients
        (``attacking``) are rewritten in place; the finite updates of the ``attack.count`` Byzantine
        clients outside the federation are returned, with the sample count each claims (the mean of
        the honest ones'): ``updates`` ``[f, P]`` and ``weights`` ``[f]``, empty without them. Those
        hold no data: their own honest update, for an attack that rewrites it, is the honest mean."""
        k, outsiders = len(updates), (self.cfg.attack.count or 0) if self.cfg.attack.type != "none" else 0
        weights = self.buffers.stats[:k, 0]
        none = SimpleNamespace(updates=updates[:0], weights=weights[:0], left_out=0)
        if not outsiders and not attacking.any():
            return none
        finite = finite_rows(updates)
        stack, mask = updates, attacking
        if outsiders:  # rows of their own after the clients' (no client of the federation is an attacker)
            # holding no data, what they would send honestly is the honest clients' mean (as in ByzFL)
            honest_mean = updates[finite].mean(dim=0) if finite.any() else updates.new_zeros(updates.shape[1])
            claimed = weights[finite].mean() if finite.any() else weights.new_zeros(())
            stack = torch.cat([updates, honest_mean.expand(outsiders, -1)])
            mask = torch.cat([attacking, attacking.new_ones(outsiders)])
            weights, finite = torch.cat([weights, claimed.expand(outsiders)]), torch.cat([finite, mask[k:]])
        self._warn_breakdown(rnd, int(mask.sum()), len(mask))
        seen = finite | mask
        view = RoundView(
            updates=stack[seen],
            weights=weights[seen].to(updates.dtype),
            attackers=mask[seen],
            generator=attack_generator(self.cfg.seed, rnd),
            aggregate=self._rule(rnd),
        )
        with user_code(f"attack {self.names['attack']} failed in round {rnd}"):
            try:
                sent = self.attack.rewrite(view)
            except TooFewUpdates:  # the attack tried the server's rule, which cannot take the round: see update
                sent = None
        if sent is not None:
            stack[mask] = self._checked(sent, int(mask.sum()), stack, rnd)
        if not outsiders:
            return none
        sending = finite_rows(stack[k:])  # a non-finite update is left out, as a client's is
        left_out = outsiders - int(sending.sum())
        if left_out:
            self._outsiders_nonfinite(rnd, left_out, outsiders)
        return SimpleNamespace(updates=stack[k:][sending], weights=weights[k:][sending], left_out=left_out)

    def _checked(self, sent, attackers: int, stack: torch.Tensor, rnd: int) -> torch.Tensor:
        """What an attack's ``rewrite`` returned, as the attackers' rows: one ``[P]`` row for all, or
        ``[a, P]``; anything else is named in one line (the attack may be the user's)."""
        length = stack.shape[1]
        if isinstance(sent, torch.Tensor) and sent.dtype.is_floating_point:
            if tuple(sent.shape) in ((length,), (attackers, length)):
                # the values are what the attackers send: a graph the attack may have built is not
                return sent.detach().to(device=stack.device, dtype=stack.dtype)
            got = f"shape {tuple(sent.shape)}"
        else:
            got = f"a tensor of {sent.dtype}" if isinstance(sent, torch.Tensor) else type(sent).__name__
        raise UserCodeError(
            f"attack {self.names['attack']} returned {got} in round {rnd}; expected a float tensor of shape "
            f"({length},), one row every attacker sends, or ({attackers}, {length}), one row per attacker"
        )

    def _outsiders_nonfinite(self, rnd: int, left_out: int, outsiders: int) -> None:
        """The rule for non-finite updates (``stop_on_nonfinite``) for the Byzantine clients outside the
        federation, which have no client id: stop under ``on_nonfinite: fail``, else leave them out, warn
        once per run (an attack that sends them does so round after round) and count them
        (``dropped_clients``)."""
        what = f"attack {self.names['attack']} sent non-finite (NaN/Inf) updates for {left_out} of the {outsiders}"
        if self.cfg.on_nonfinite == "fail":
            raise NonFiniteError(
                f"round {rnd}: {what} Byzantine clients of attack.count "
                f"(on_nonfinite: fail; use drop to leave such clients out)"
            )
        if not self._warned_outsiders:
            self._warned_outsiders = True
            logger.warning(
                f"round {rnd}: {what} Byzantine clients of attack.count; dropped them, as in every such round "
                f"(said once per run; dropped_clients counts them)"
            )

    def _warn_breakdown(self, rnd: int, count: int, n: int) -> None:
        """Once per run: a round in which half the clients or more, or more than the rule withstands,
        are Byzantine."""
        tolerates = getattr(self.aggregate, "tolerates", None)
        if self._warned_breakdown or not (2 * count >= n or (tolerates and count > tolerates(n))):
            return
        self._warned_breakdown = True
        why = (
            "half or more: no rule can tell them from the honest ones"
            if 2 * count >= n
            else f"more than {self.names['aggregator']} withstands among {n} (f = {tolerates(n)})"
        )
        logger.warning(f"round {rnd}: {count} of the round's {n} clients are Byzantine, {why} (said once per run)")

    def _rule(self, rnd: int, keeps_memory: bool = False):
        """The run's pre-aggregators and rule, named in one line if they raise or return what cannot
        be a step of the global weights (the rule may be the user's, and its probe saw only a few values
        on the CPU). A rule with a memory reads the one the last round kept; ``keeps_memory``: what the
        call leaves is kept with the round (the algorithm's call; an attack's tries leave nothing)."""

        def memory() -> Memory:
            new = Memory(self.state.aggregator_state)
            if keeps_memory:
                self._memory = new
            return new

        rule = pre_aggregated(
            self.pre_aggregators, self.aggregate, lambda: pre_aggregation_generator(self.cfg.seed, rnd), memory
        )

        def aggregate(updates, weights, expand=None):
            read = [updates]  # the stack the rule reads: the rows an attack's ``expand`` gives back

            def expanded(stack):
                read.append(expand(stack))
                return read[-1]

            with user_code(f"aggregator {self.names['aggregator']} failed in round {rnd}"):
                out = rule(updates, weights) if expand is None else rule(updates, weights, expand=expanded)
            like = read[-1]
            expected = f"a tensor of shape ({like.shape[1]},), {like.dtype} on {like.device}, as the updates"
            if not isinstance(out, torch.Tensor):
                got = type(out).__name__
            elif (out.shape, out.dtype, out.device) != (like.shape[1:], like.dtype, like.device):
                got = f"shape {tuple(out.shape)}, {out.dtype} on {out.device}"
            else:
                return out
            raise UserCodeError(
                f"aggregator {self.names['aggregator']} returned {got} in round {rnd} for {len(like)} "
                f"updates of {like.shape[1]} values; expected {expected}"
            )

        if is_equivariant(rule):
            return equivariant(aggregate)
        return expanding(aggregate) if is_expanding(rule) else aggregate

    def _advice(self) -> list[str]:
        """What to change when every update of a round is non-finite, where local.lr is not all to
        blame: a clip that adaptive clipping has moved, and the noise with it, or a global model that
        earlier rounds blew up (an attack the rule let through)."""
        if self.privacy and self.privacy.current_clip != self.privacy.clip:
            moved = f"{self.privacy.clip:g} to {self.privacy.current_clip:.3g}"
            return [
                f"lower local.lr or privacy.clip_learning_rate (adaptive clipping has moved privacy.clip from {moved})"
            ]
        largest = float(self.state.model.flat.abs().max())
        if largest <= _BLOWN_UP:
            return []
        names = self.names
        attack = (
            f" (attack {names['attack']}, which {names['aggregator']} let through)" if names["attack"] != "none" else ""
        )
        return [f"the global model's weights reach {largest:.3g}, blown up by an earlier round's aggregate{attack}"]

    def update(self, rnd: int, round_: Round) -> None:
        """The new global model; a non-finite one is never kept. The global state can become
        non-finite although every client update is finite (a rule or a server optimizer can
        overflow)."""
        state, names = self.state, self.names
        rows = self._client_rows(round_)
        try:
            with user_code(f"algorithm {names['algorithm']}: server_update failed in round {rnd}"):
                delta = self.algorithm.server_update(round_, state.server_state, rows)
        except TooFewUpdates as error:
            self._memory = None
            self._left_out(rnd, len(round_.updates), error)
            return
        why = " although every client update used was finite"
        advice = "lower server_lr or attack.scale, or bound updates with aggregator: norm_clip"
        check_finite(
            state,
            delta,
            rnd,
            f"the update of {names['algorithm']} with the rule {names['aggregator']} is non-finite",
            why,
            advice,
        )
        state.step(delta)
        check_finite(
            state,
            state.model.flat,
            rnd,
            f"the server optimizer {names['server_optimizer']} made the global weights non-finite",
            why,
            advice,
        )
        for name, tensor in state.server_state.items():
            check_finite(state, tensor, rnd, f"the algorithm's state {name!r} became non-finite", why, advice)
        if self._memory is not None:
            for name, tensor in self._memory.new.items():
                check_finite(state, tensor, rnd, f"the rule's memory {name!r} became non-finite", why, advice)
            state.aggregator_state, self._memory = self._memory.new, None
        clients = round_.clients.tolist()
        for name, tensor in rows.items():  # kept only once the whole round is
            check_finite(state, tensor, rnd, f"the algorithm's client state {name!r} became non-finite", why, advice)
            state.clients.scatter(name, clients, tensor)

    def _left_out(self, rnd: int, count: int, error: TooFewUpdates) -> None:
        """A round whose updates are too few for the rule (dropouts or availability thinned it below
        the clients_per_round the run was checked with) changes nothing: the global model, the
        server's and the clients' states stay as they were, as in a round no client reported to.
        Said once per run; summary.json counts such rounds (``rounds_left_out``)."""
        self.state.rounds_left_out += 1
        if not self._warned_too_few:
            self._warned_too_few = True
            logger.warning(
                f"round {rnd}: its {count} updates are too few for {self.names['aggregator']} "
                f"({str(error).partition(': ')[2]}); such a round changes nothing "
                f"(said once per run; summary.json's rounds_left_out counts them)"
            )

    def _client_rows(self, round_: Round) -> dict[str, torch.Tensor]:
        """The algorithm's rows of the round's kept clients as they started the round (copies), the
        personal states the clients trained replaced by their new values."""
        rows = {name: tensor[round_.slots] for name, tensor in self.buffers.client_state.items()}
        for name in self.algorithm.personal_state:
            rows[name].copy_(round_.reports[name])
        return rows
