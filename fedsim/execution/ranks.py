"""Several ranks as an executor: each rank trains its share of a round with an executor of its
own (its worker pool), the leader (rank 0) then holds every rank's rows, and after the leader's
update every rank takes the new state. The engine on the leader sees one executor that trains
the whole round; the other ranks run ``follow``, the same rounds without collecting, updating
or recording. See distributed.py for how the ranks talk."""

from __future__ import annotations

import socket
from collections.abc import Callable

import torch

from ..core.errors import FedsimError
from ..engine.loop import Engine, Executor
from ..engine.state import GlobalState
from ..experiment.config import Config
from .distributed import Ranks, RankStopped
from .executors import Wrapper
from .interrupts import Terminated
from .pool import slot_groups
from .resources import peak_memory_mb


class RanksExecutor(Wrapper):
    def __init__(self, inner: Executor, ranks: Ranks, config: Config, state: GlobalState, device: torch.device):
        self.inner, self.ranks, self.config, self.state, self.device = inner, ranks, config, state, device
        self.rank_memory = None  # every rank's memory figures, on the leader once the run ends

    def share_start(self, first_round: int) -> int:
        """Every rank starts from the leader's state (a resumed run's, read on the leader only) and
        first round, which is returned."""
        first_round = self.ranks.decide(first_round, "starting")
        self.ranks.share(self.state.tensors(), "starting")
        return first_round

    def train(self, rnd: int, clients: torch.Tensor, start_from: torch.Tensor) -> None:
        """This rank's share of the slot groups, then every rank's rows on the leader. A rank that
        fails says so to the others, and every rank stops."""
        groups = slot_groups(self.config, len(clients))
        # the leader's rows of the clients' own state (the others keep none)
        self.ranks.share(
            [rows[: len(clients)] for rows in self.buffers.client_state.values()], f"round {rnd}'s client state"
        )
        error = None
        try:
            self.inner.train(rnd, clients, start_from, groups=self.ranks.groups(groups))
        except FedsimError as e:
            error = str(e)
        self.ranks.agree(error, f"round {rnd}'s training")
        self.ranks.gather_rows(self.buffers, groups, f"gathering round {rnd}")

    def agree(self, compute: Callable[[], object]) -> object:
        """The leader's ``compute()`` (the candidates' losses), so that every rank plans the same round."""
        return self.ranks.decide(compute() if self.ranks.is_root else None, "planning a round")

    def end_round(self, rnd: int, clients: torch.Tensor, go_on: bool) -> None:
        """The leader, after recording its round: tell the others whether to go on, and give them
        the state."""
        self.ranks.decide("next" if go_on else "done", f"ending round {rnd}")
        if go_on:
            self._exchange_state(rnd)

    def follow(self, engine: Engine, first_round: int) -> None:
        """The rounds of a rank other than the leader: plan and train its share, then take the
        leader's state, until the leader says the run is over."""
        for rnd in range(first_round, self.config.rounds + 1):
            clients = torch.from_numpy(engine.plan(rnd).clients)
            self.train(rnd, clients, self.state.model.flat)
            decision = self.ranks.decide(None, f"ending round {rnd}")
            if decision == "failed":
                raise RankStopped("")
            if decision == "done":
                return
            self._exchange_state(rnd)

    def _exchange_state(self, rnd: int) -> None:
        """The leader's global weights and server state on every rank (the clients' own state stays
        on the leader, which shares the rows of the next round's clients when it trains them)."""
        state = self.state
        self.ranks.share([state.model.flat, *state.server_state.values()], f"sharing round {rnd}'s update")

    def close(self, finished: bool = True, ended_by: BaseException | None = None) -> None:
        """Stop this rank's workers. Ranks still in step then talk once more: the leader tells the
        others when it stops early, and every rank reports its memory to the leader. A signal
        stops each rank wherever it is, not at the same collective, so then none is started; a
        rank that is gone makes them fail, and then there is nothing to tell or collect."""
        memory = {
            "rank": self.ranks.rank,
            "host": socket.gethostname(),
            "device": str(self.device),
            "server_peak_memory_mb": peak_memory_mb(self.device),
            # workers: 0 trains in the rank's own process, whose figure is the server's
            "worker_peak_memory_mb": [round(b / 2**20, 1) for b in self.inner.peak_memory]
            if self.config.workers
            else [],
        }
        self.inner.close()
        if isinstance(ended_by, (KeyboardInterrupt, Terminated)):
            return
        try:
            if self.ranks.is_root and not finished and not isinstance(ended_by, RankStopped):
                self.ranks.decide("failed", "stopping")
            self.rank_memory = self.ranks.collect(memory, "collecting the ranks' memory")
        except FedsimError:
            self.rank_memory = None
