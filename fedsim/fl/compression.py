"""Compressed client updates: what each client sends the server in place of its whole update.

Its keys, their defaults and meanings are declared once, in ``CompressionConfig`` below (``fedsim list
keys`` prints them).

``topk`` (Stich, Cordonnier, Jaggi 2018, "Sparsified SGD with memory") sends the k = round(ratio
x n) coordinates of largest magnitude (at least one). ``qsgd`` (Alistarh, Grubic, Li, Tomioka,
Vojnovic 2017, "QSGD: communication-efficient SGD via gradient quantization and encoding") sends,
for each bucket v of ``bucket_size`` coordinates, ||v||_2 and for every coordinate sign(v_i) and
xi_i in {0, ..., s}: with r = s |v_i| / ||v||, xi_i is floor(r) + 1 with probability r -
floor(r), else floor(r); the server reads ||v|| sign(v_i) xi_i / s, whose expectation is v_i
(Lemma 3.1: E||Q(v) - v||^2 <= min(d / s^2, sqrt(d) / s) ||v||^2 for buckets of d values).

Error feedback (Stich et al.'s memory, and the same for qsgd when asked): a client compresses
its update plus its residual, what it has not sent before, and keeps the difference as its new
residual, so sent + new residual = update + old residual. The residuals are per client, kept with the rest of
the clients' state (client_state.py: host memory, only for the clients that have sent an update,
bounded by ``client_state_limit_mb``, part of the checkpoint).

What is compressed: the trainable parameters' part of the update (n values). Buffers (batch-norm
statistics) and an algorithm's reports (SCAFFOLD's control change) travel whole, as float32:
quantization noise on a running variance could make it negative. The randomness of qsgd comes
from the stream ``(seed, round, client)`` of ``streams.compression_generator``, drawn on the CPU,
and everything here runs on the server, so a run gives the same numbers for any number of
workers and continues exactly after a resume.

Where it plugs in (engine/update.py): after an attack has rewritten the attackers' updates, before
the non-finite updates are left out and the rule aggregates. A Byzantine client chooses what it
sends, but it still has to send a message the server can decode: under ``topk`` k values and
their indices, under ``qsgd`` norms, signs and levels. Rewriting the compressed message instead
would let the gaussian attack send a dense vector through a top-k channel, and the bytes counted
would not be what travelled. Under privacy the server clips what arrives, so DP-FedAvg's bound
holds for a message computed from the client's update and a fresh stream; error feedback, state
kept across rounds, is refused there (see privacy.py). Hogwild has no client updates and refuses
compression (validation.check_hogwild).

What travels (``message_bytes``): none, 4 n bytes; topk, 8 k bytes (a float32 value and an int32
index per coordinate kept); qsgd, ceil((32 B + n (1 + ceil(log2(s + 1)))) / 8) bytes for B =
ceil(n / bucket_size) buckets: a float32 norm per bucket and, per coordinate, a sign bit and xi
in ceil(log2(s + 1)) bits, packed (the paper's Elias coding of the levels can be shorter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.blocks import all_finite
from ..core.checks import Checks
from ..core.registry import Registry
from ..core.sections import option
from ..core.streams import compression_generator
from .client_state import ClientStates

COMPRESSORS = Registry("compressor")
MAX_LEVELS = 2**16 - 1  # a level in 16 bits; with more, a coordinate costs over half of its float32
_CHECKS = Checks("compression")
RESIDUAL = "error_feedback"  # its name among the clients' state


def _not_read_by_compressor(key: str, section: Any, config: Any) -> str | None:
    if section.type not in COMPRESSORS or key in COMPRESSORS.get(section.type).options:
        return None
    return f"compression.type {section.type} does not use it"


@dataclass
class CompressionConfig:
    """The ``compression:`` section; the defaults send every update whole."""

    type: str = option(
        "none",
        "what each client sends: its whole update (`none`), `topk` or `qsgd` (see "
        "[Compressed updates](algorithms.md#compressed-updates))",
    )
    ratio: float = option(0.01, "`topk`: the share of the coordinates a client sends", unread=_not_read_by_compressor)
    levels: int = option(15, "`qsgd`: s quantization levels of |v_i| / ||v||", unread=_not_read_by_compressor)
    bucket_size: int | None = option(
        512, "`qsgd`: coordinates that share one norm; `null`: the whole update", unread=_not_read_by_compressor
    )
    error_feedback: bool | None = option(
        None,
        "clients keep what they have not sent and add it to their next update; `null`: on for `topk`, off for `qsgd`",
    )

    def check(self) -> None:
        """One-line ConfigErrors naming the key."""
        _CHECKS.choice("type", self.type, COMPRESSORS)
        _CHECKS.within("ratio", self.ratio, 0, 1, "(]")
        _CHECKS.within("levels", self.levels, 1, MAX_LEVELS)
        if self.bucket_size is not None:
            _CHECKS.at_least("bucket_size", self.bucket_size, 1)
        if self.type == "none" and self.error_feedback:
            _CHECKS.fail(
                "error_feedback",
                "compression.type none sends every update whole, so nothing is left to feed "
                "back; choose compression.type topk or qsgd",
            )


class Compressor:
    """Send the update whole, as float32 values."""

    options: tuple[str, ...] = ()  # the keys of the section it reads
    random = False  # whether it draws from its generator
    error_feedback = False  # its error feedback when the section leaves it null

    def __init__(self, section: CompressionConfig):
        self.section = section

    def __call__(self, v: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """What the server reads of ``v`` ([n]), as a new tensor of ``v``'s dtype and device."""
        return v.clone()

    def message_bytes(self, n: int) -> int:
        return 4 * n


COMPRESSORS.register("none", "send every update whole (float32)")(Compressor)


@COMPRESSORS.register(
    "topk",
    "send the ratio x n largest-magnitude coordinates, values and indices "
    "(Stich et al. 2018; error feedback on by default)",
)
class TopK(Compressor):
    options = ("ratio",)
    error_feedback = True

    def kept(self, n: int) -> int:
        return min(n, max(1, round(self.section.ratio * n)))

    def __call__(self, v: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        index = v.abs().topk(self.kept(len(v)), sorted=False).indices
        sent = torch.zeros_like(v)
        sent[index] = v[index]
        return sent

    def message_bytes(self, n: int) -> int:
        return 8 * self.kept(n)  # a float32 value and an int32 index per coordinate kept


@COMPRESSORS.register(
    "qsgd",
    "send per bucket its norm, per coordinate a sign and a level in 0..levels "
    "rounded at random without bias (Alistarh et al. 2017)",
)
class QSGD(Compressor):
    options = ("levels", "bucket_size")
    random = True

    def bucket(self, n: int) -> int:
        return min(self.section.bucket_size or n, n)

    def __call__(self, v: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        s, n = self.section.levels, len(v)
        d = self.bucket(n)
        # float64: a float32 bucket's norm cannot overflow there, and r is exact enough that the
        # rounding's bias (a few 2^-53 relative) is far below what any test or run can see
        x = torch.nn.functional.pad(v.double(), (0, -n % d)).view(-1, d)
        norms = x.norm(dim=1, keepdim=True)
        r = x.abs() / torch.where(norms > 0, norms, 1) * s
        low = r.floor()
        u = torch.rand(x.shape, generator=generator, dtype=torch.float64).to(x.device)
        levels = (low + (u < r - low)).clamp_(max=s)  # r may exceed s by a rounding of the norm
        return (x.sign() * levels * (norms / s)).flatten()[:n].to(v.dtype)

    def message_bytes(self, n: int) -> int:
        buckets = -(-n // self.bucket(n))
        bits = 32 * buckets + n * (1 + self.section.levels.bit_length())  # bit_length(s) = ceil(log2(s + 1))
        return -(-bits // 8)


def feeds_back(section: CompressionConfig) -> bool:
    """Whether the clients keep residuals: ``error_feedback``, or the compressor's usual choice."""
    if section.error_feedback is None:
        return COMPRESSORS.get(section.type).error_feedback
    return section.error_feedback


def client_shapes(section: CompressionConfig, n: int) -> dict[str, tuple[int, ...]]:
    """The rows each client keeps (see client_state.py): with error feedback, a residual of the n
    trainable values."""
    return {RESIDUAL: (n,)} if section.type != "none" and feeds_back(section) else {}


class Compression:
    """A run's compressor and, with error feedback, every client's residual: the row
    ``error_feedback`` of the run's ClientStates (see ``client_shapes``)."""

    def __init__(self, section: CompressionConfig, seed: int):
        self.compressor = COMPRESSORS.get(section.type)(section)
        self.error_feedback = feeds_back(section)
        self.seed = seed
        self.states: ClientStates | None = None  # set by use_states

    @classmethod
    def from_config(cls, cfg: Any) -> Compression | None:
        """The run's Compression, or None when every update is sent whole."""
        return None if cfg.compression.type == "none" else cls(cfg.compression, cfg.seed)

    def use_states(self, states: ClientStates) -> None:
        self.states = states

    def compress(self, updates: torch.Tensor, clients: list[int], usable: torch.Tensor, rnd: int) -> None:
        """Replace each usable row of ``updates`` ([k, n], in place) by what client ``clients[i]``
        sends in round ``rnd``, and keep its new residual. A row whose message or residual is not
        finite (a huge update can overflow) becomes unusable (``usable[i]`` False, in place) and
        leaves the client's residual as it was."""
        for i, client in enumerate(clients):
            if not usable[i]:
                continue
            row = updates[i]
            old = self.states.get(RESIDUAL, client) if self.error_feedback else None
            target = row + old.to(row.device) if old is not None else row
            generator = compression_generator(self.seed, rnd, client) if self.compressor.random else None
            sent = self.compressor(target, generator)
            residual = target - sent if self.error_feedback else None
            if not (all_finite(sent) and (residual is None or all_finite(residual))):
                usable[i] = False
                continue
            if self.error_feedback:
                self.states.put(RESIDUAL, client, residual)
            row.copy_(sent)
