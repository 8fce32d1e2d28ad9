"""One record per sampled client and round: the schema of ``clients.csv``."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional, Union


@dataclass
class ClientRecord:
    round: int
    client: int
    samples: int
    train_loss: float  # the mean loss of its local training (NaN where its work was lost)
    update_norm: float  # ||client weights - global weights|| (NaN where there is no update of its own)
    dropped: Union[int, str]  # 0, or why its work did not count: nonfinite, dropout, straggler
    attacker: int
    steps: int  # local steps taken: fewer than its full work for a partial straggler, 0 where lost
    model_version: Optional[int] = None  # the server updates applied before it started: the model it trained
    staleness: Optional[int] = None  # the server updates applied while it trained (None where its work was lost)

    def as_row(self) -> dict:
        return dict(vars(self))

    @classmethod
    def lost(cls, rnd: int, client: int, samples: int, why: str, attacker: int,
             model_version: Optional[int] = None) -> "ClientRecord":
        """A sampled client whose work never reached the server: no loss, no update, no steps."""
        return cls(rnd, client, samples, math.nan, math.nan, why, attacker, 0, model_version)


CLIENT_COLUMNS = tuple(f.name for f in fields(ClientRecord))
