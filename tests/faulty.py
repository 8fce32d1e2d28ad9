"""An algorithm that breaks a worker on purpose, so tests can watch the engine cope.

It is FedAvg (the base class) in every respect but one: when client ``client`` trains in
round ``round``, it strikes. ``raise``, ``exit``, ``kill`` and ``hang`` strike in the worker
before the client trains; ``nan`` lets it train and then poisons its finished weights (one
value becomes NaN in the buffer the server reads). With ``once`` (a path) it strikes only
while that file does not exist, and creates it when striking: a round re-run after a restart
then goes through. Named in an experiment file as::

    algorithm: faulty:Faulty            # the tests directory must be on PYTHONPATH
    algorithm_options: {kind: raise, round: 2, client: 5}
"""

from __future__ import annotations

import os
import signal
import time

from fedsim.algorithms import Algorithm

KINDS = ("raise", "exit", "kill", "hang", "nan")


class Faulty(Algorithm):
    """FedAvg, with one injected fault (see the module docstring)."""

    def __init__(self, kind: str, round: int, client: int, once: str | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r}; choose one of: {', '.join(KINDS)}")
        self.kind, self.round, self.client, self.once = kind, int(round), int(client), once

    def _strikes(self, ids, rnd: int) -> bool:
        if rnd != self.round or self.client not in [int(c) for c in ids]:
            return False
        if self.once:
            if os.path.exists(self.once):
                return False
            open(self.once, "w").close()
        return True

    def start_client(self, clients):
        if self.kind != "nan" and self._strikes(clients.ids, clients.round):
            if self.kind == "raise":
                raise RuntimeError("injected fault")
            if self.kind == "exit":
                os._exit(3)
            if self.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.kind == "hang":
                time.sleep(3600)
        return [int(c) for c in clients.ids], clients.round  # comes back as `local` in client_report

    def client_report(self, result, local):
        ids, rnd = local
        if self.kind == "nan" and self._strikes(ids, rnd):
            result.weights[ids.index(self.client), 0] = float("nan")
        return {}
