"""What each client carries from one round to the next, in one place: an algorithm's client state
(SCAFFOLD's control variate, Ditto's personal model, FedPer's head) and compression's
error-feedback residual.

The rows live in host memory, float32, and only for the clients that have one: a client that
has not taken part yet has none (its algorithm says what it starts from), and a client that is
not sampled keeps its row as it is. The most they can take, every client of the federation with
every row, is known before the first round: a run refuses to start when it would exceed
``client_state_limit_mb`` (default: half of the host's memory), says it at start-up, and
summary.json says what they held at the end. The rows are part of the checkpoint.

The server alone reads and writes them. The round's rows travel to the workers in the round's
buffers (``RoundBuffers.client_state``, one row per slot), filled before the workers train, so
the numbers are the same for any number of workers or ranks.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from ..core.checks import is_integer
from ..core.errors import ConfigError, FedsimError

LIMIT_KEY = "client_state_limit_mb"


def host_memory_mb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    except (ValueError, OSError, AttributeError):
        return math.inf  # unknown: no default bound


class ClientStates:
    """``shapes``: name -> the shape of one client's row; ``owners``: name -> who keeps it (for
    messages: "algorithm scaffold", "compression.error_feedback")."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        owners: dict[str, str],
        num_clients: int,
        limit_mb: float | None = None,
    ):
        self.shapes, self.owners, self.num_clients = dict(shapes), dict(owners), num_clients
        self.rows: dict[str, dict[int, torch.Tensor]] = {name: {} for name in shapes}
        limit = host_memory_mb() / 2 if limit_mb is None else limit_mb
        if self.bound_mb() > limit:
            what = ", ".join(f"{owner} {self.row_bytes(name) / 2**20:.2f} MiB" for name, owner in self.owners.items())
            raise ConfigError(
                f"{LIMIT_KEY}: the clients' state would take up to {self.bound_mb():,.1f} MiB of host "
                f"memory ({what} per client, {num_clients:,} clients), over the limit of {limit:,.1f} "
                f"MiB; raise {LIMIT_KEY}, or use fewer clients or a smaller model"
            )

    @classmethod
    def of(
        cls, owners: dict[str, dict[str, tuple[int, ...]]], num_clients: int, limit_mb: float | None
    ) -> ClientStates:
        """``owners``: who keeps rows (named for messages) -> their names and shapes."""
        shapes, owner_of = {}, {}
        for owner, rows in owners.items():
            for name, shape in rows.items():
                if name in shapes:
                    raise ConfigError(
                        f"{owner.split()[0]}: {owner} keeps a client state named {name!r}, as "
                        f"{owner_of[name]} does; one of them must use another name"
                    )
                shapes[name], owner_of[name] = tuple(shape), owner
        return cls(shapes, owner_of, num_clients, limit_mb)

    def row_bytes(self, name: str) -> int:
        return 4 * math.prod(self.shapes[name])

    def bound_mb(self) -> float:
        """The most the rows can take: every client with every row."""
        return self.num_clients * sum(self.row_bytes(name) for name in self.shapes) / 2**20

    def get(self, name: str, client: int) -> torch.Tensor | None:
        return self.rows[name].get(client)

    def put(self, name: str, client: int, value: torch.Tensor) -> None:
        self.rows[name][client] = value.detach().to("cpu", torch.float32, copy=True)

    def gather(self, name: str, clients: list[int], start: torch.Tensor) -> torch.Tensor:
        """The rows of ``clients`` ([k, ...], on ``start``'s device); ``start`` for a client without one."""
        held = self.rows[name]
        return (
            torch.stack([held[c].to(start.device) if c in held else start for c in clients])
            if clients
            else start.new_zeros(0, *start.shape)
        )

    def scatter(self, name: str, clients: list[int], values: torch.Tensor) -> None:
        for client, value in zip(clients, values):
            self.put(name, client, value)

    def describe(self) -> str:
        """The start-up line: what each owner keeps per client and the most it can take."""
        per_owner: dict[str, int] = {}
        for name, owner in self.owners.items():
            per_owner[owner] = per_owner.get(owner, 0) + self.row_bytes(name)
        each = ", ".join(f"{owner} {_size(size)}" for owner, size in per_owner.items())
        bound = f"{self.bound_mb():,.1f} MiB" if self.bound_mb() >= 0.1 else _size(self.bound_mb() * 2**20)
        most = f"at most {self.num_clients:,} clients, {bound}"
        return f"client state in host memory: {each} per client that has one; {most}"

    def summary(self) -> dict:
        """What the rows hold now, for summary.json."""
        if not self.shapes:
            return {}
        size = sum(t.numel() * 4 for held in self.rows.values() for t in held.values())
        return {
            "client_state_clients": {name: len(held) for name, held in self.rows.items()},
            "client_state_mb": round(size / 2**20, 2),
            "client_state_bound_mb": round(self.bound_mb(), 2),
        }

    def state_dict(self) -> dict:
        return {name: dict(held) for name, held in self.rows.items()}

    def load_state_dict(self, saved: object, source: Path) -> None:
        """The rows of a checkpoint, each checked: a float32 row of this run's shape, for a client
        of the federation, under a name this run keeps."""
        if not isinstance(saved, dict) or not all(isinstance(v, dict) for v in saved.values()):
            raise FedsimError(
                f"{source}: holds a {type(saved).__name__} for client_state where rows by name and "
                f"client belong; it is not this run's checkpoint"
            )
        for name, held in saved.items():
            if held and name not in self.shapes:
                raise FedsimError(
                    f"{source}: holds client state {name!r}, which this run does not keep; it is not "
                    f"this run's checkpoint"
                )
            for client, value in held.items():
                if not (
                    is_integer(client)
                    and 0 <= client < self.num_clients
                    and isinstance(value, torch.Tensor)
                    and tuple(value.shape) == tuple(self.shapes[name])
                    and value.dtype == torch.float32
                    and torch.isfinite(value).all()
                ):
                    raise FedsimError(
                        f"{source}: holds client state {name!r} for client {client!r} that this run "
                        f"({self.num_clients} clients) cannot use: it needs finite float32 of shape "
                        f"{tuple(self.shapes[name])}; it is not this run's checkpoint"
                    )
        for name in self.shapes:
            self.rows[name] = dict(saved.get(name, {}))


def _size(size: float) -> str:
    """Bytes as a person reads them: MiB from 0.01 MiB (0.76 MiB), else KiB (3.2 KiB) or bytes."""
    if size >= 0.01 * 2**20:
        return f"{size / 2**20:,.2f} MiB"
    return f"{size / 2**10:.1f} KiB" if size >= 2**10 else f"{int(size)} bytes"
