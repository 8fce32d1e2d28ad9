"""Aggregation rules and pre-aggregators: pure functions of stacked client updates.

A rule takes ``updates``, a ``[k, P]`` float tensor (one row per client: its weights minus
the global weights), and ``weights``, the ``k`` client sample counts (integer or float), and
returns the aggregated ``[P]`` update on the same device; a rule that draws at random (``dnc``)
also takes a ``generator`` keyword, the round's own stream, and a rule that remembers earlier
rounds (``history.py``: centered clipping, clipped clustering) a ``memory`` keyword. Rules are whole-tensor operations:
no Python loop over parameters (the geometric median loops over its iterations).
``get(name, **options)`` builds a rule from the registry; options are checked when the rule is
built, and the ones that depend on the number of clients ``k`` when it is called, so that
config validation (which calls the rule once on ``clients_per_round`` rows) reports them.

A pre-aggregator (``preaggregation.py``: clipping, NNM, bucketing, ARC) maps the stack to
another stack before the rule sees it; ``pre_aggregated`` composes them in order with a rule.
Those that read the updates only through their inner products are marked ``equivariant``: the
optimal attacks try them on the updates' coordinates in their span (and a composition whose rule
is not, on the rows those coordinates stand for once the equivariant steps are done: ``expanding``).

The robust rules (``median``, ``trimmed_mean``, ``krum``, ``multi_krum``, ``bulyan``) ignore the
sample counts, as in their papers: an attacker could otherwise claim a large count.

Every rule maps finite updates to a finite aggregate, however large (float32 updates up to
3.4e38, as an attacker may send): means are convex combinations (``combine``), whose partial
sums never exceed the largest value, rather than sums divided afterwards; norms and distances
are accumulated in float64 (``row_norms``, ``squared_distances``), where float32 squares overflow.

The families are the modules of this package, each registering its own: ``means.py``,
``statistics.py`` (coordinate-wise), ``distances.py`` (whole updates compared), and
``preaggregation.py``; ``history.py`` holds the rules with a memory.
"""

from __future__ import annotations

import collections
import functools
import importlib
import inspect
import logging
import pkgutil
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from ...core.blocks import gram, row_norms
from ...core.checks import Checks, refuse_unknown
from ...core.errors import ConfigError
from ...core.registry import Registry

logger = logging.getLogger("fedsim")

Rule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
AGGREGATORS = Registry("aggregator")

# ``(updates [k, P], weights [k], generator) -> (updates [k', P], weights [k'])``
PreAggregator = Callable[[torch.Tensor, torch.Tensor, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
PRE_AGGREGATORS = Registry("pre-aggregator")


def get(name: str, **options: Any) -> Rule:
    """The rule ``name`` with its options, e.g. ``get("trimmed_mean", beta=0.1)``."""
    factory = AGGREGATORS.get(name)
    refuse_unknown("aggregator_options", name, options, list(inspect.signature(factory).parameters))
    return factory(**options)


def takes_generator(rule: Rule) -> bool:
    """Whether ``rule`` draws at random: it takes a ``generator`` keyword, which the run fills with
    the round's stream (see ``preaggregation.pre_aggregated``)."""
    try:
        return "generator" in inspect.signature(rule).parameters
    except (TypeError, ValueError):
        return False


class Memory:
    """What a rule with a memory keeps between rounds, as a dict of tensors: ``kept``, what it left
    after the last round the run kept (read it, never change it), and ``new``, what it leaves after
    this call (replace entries, starting from ``kept``). The run keeps ``new`` of the call its
    algorithm makes, once the round's update is kept, and saves it in its checkpoints; an attack
    that tries the server's aggregate leaves nothing behind."""

    def __init__(self, kept: dict[str, torch.Tensor]):
        self.kept, self.new = kept, dict(kept)


def remembering(rule: Rule, start: Callable[[torch.Tensor], dict[str, torch.Tensor]]) -> Rule:
    """``rule``, which takes a ``memory`` keyword (a ``Memory``), marked with what it remembers
    before the first round: ``start(global_weights)``, a dict of tensors on their device. Called
    without a memory (alone, or by config validation's probe), it is given a fresh one, started
    from ``start`` of the first update; a run passes the memory its last round left."""

    @functools.wraps(rule)
    def remembered(updates, weights, memory=None, **options):
        return rule(updates, weights, memory=Memory(start(updates[0])) if memory is None else memory, **options)

    remembered.start_memory = start
    return remembered


def remembers(rule: Rule) -> bool:
    """Whether ``rule`` keeps a memory between rounds (see ``remembering``)."""
    return callable(getattr(rule, "start_memory", None))


def tolerating(rule: Rule, tolerates: Callable[[int], int]) -> Rule:
    """``rule``, marked with the most Byzantine updates among ``k`` it is built to withstand (its
    breakdown point, or the ``f`` it assumes): a round with more says so (engine/update.py)."""
    rule.tolerates = tolerates
    return rule


def equivariant(step: Callable) -> Callable:
    """``step`` (a rule or a pre-aggregator), marked as reading the updates only through their
    inner products (lengths, distances, angles) and returning combinations of them: it commutes
    with every rotation of the space, ``step(X Q) = step(X) Q`` for any orthogonal ``Q``. Given the
    updates' coordinates in an orthonormal basis of their span (``core.blocks.span_coordinates``),
    at most k columns however long the updates, it returns its result's coordinates there: the
    optimal attacks' line search tries the server's aggregate so. A coordinate-wise rule (median,
    trimmed mean) is not, and neither is a rule whose memory holds a vector."""
    step.equivariant = True
    return step


def is_equivariant(step: Callable) -> bool:
    """Whether ``step`` is marked by ``equivariant``."""
    return getattr(step, "equivariant", False) is True


def expanding(aggregate: Callable) -> Callable:
    """``aggregate`` (a composition of pre-aggregators and a rule), marked as starting with
    ``equivariant`` steps and then something that is not (a coordinate-wise rule after clipping and
    NNM). It takes an ``expand`` keyword, a map applied to the stack after those steps: the optimal
    attacks give it the updates' coordinates in their span, and ``expand`` the rows they stand
    for, which the rest of the composition reads."""
    aggregate.expanding = True
    return aggregate


def is_expanding(aggregate: Callable) -> bool:
    """Whether ``aggregate`` is marked by ``expanding``."""
    return getattr(aggregate, "expanding", False) is True


def with_assumed_attackers(name: str, options: dict, f: int, registry: Registry = AGGREGATORS) -> dict:
    """``options`` with ``f``, the number of Byzantine clients the run has, where the rule or
    pre-aggregator ``name`` takes an ``f`` and ``options`` neither set it nor chose another bound
    (``trimmed_mean``'s ``beta``)."""
    params = inspect.signature(registry.get(name)).parameters
    if "f" not in params or "f" in options or "beta" in options:
        return options
    return {**options, "f": f}


# ----------------------------------------------------------------------------- option checks


OPTIONS = Checks("aggregator_options", options=True)


def fail(message: str) -> NoReturn:
    raise ConfigError(f"aggregator_options: {message}")


class TooFewUpdates(ConfigError):
    """A rule or pre-aggregator given fewer updates than its options need: refused before a run
    whose rounds would all be so, a round of a run that dropouts or availability thinned left out
    (engine/update.py)."""


def too_few(message: str) -> NoReturn:
    raise TooFewUpdates(f"aggregator_options: {message}")


def normalized(weights: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    w = weights.to(device=like.device, dtype=like.dtype)
    return w / w.sum()


def combine(coefficients: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``coefficients @ rows`` in the rows' dtype, for coefficients >= 0 summing to at most 1:
    a weighted mean, possibly of scaled-down rows.

    Every partial sum, in any summation order, is then a combination of values with
    coefficients summing to at most 1, so no larger than the largest ``|value|`` up to
    rounding; a sum divided afterwards overflows float32 once the values pass 3.4e38 / k.
    Rounding alone can lift a result within ~k * 6e-8 of the float32 limit past it; the exact
    result is within the limit, so the clamp only undoes that rounding. (A partial sum can only
    overflow if its coefficients sum to nearly 1, so the other terms are too small to matter and
    no partial sum can overflow the other way: the clamp sees inf, never NaN.)
    """
    limit = torch.finfo(rows.dtype).max
    return (coefficients.to(rows.dtype) @ rows).clamp_(-limit, limit)


def mean_of(rows: torch.Tensor) -> torch.Tensor:
    """The unweighted mean of the rows, as a convex combination (see ``combine``)."""
    return combine(normalized(rows.new_ones(rows.shape[0]), rows), rows)


_NETWORK_ROWS = 128  # on a CPU, up to here the network sorts faster than torch.sort (bench_aggregation --sort)
_NETWORK_ROWS_ELSEWHERE = 24  # a GPU launches two kernels a compare-exchange, torch.sort one call
_NETWORK_COLUMNS = 1 << 14  # the network's columns at a time: k rows of them stay in the CPU's cache


@functools.cache
def sorting_network(k: int) -> tuple[tuple[int, int], ...]:
    """The compare-exchanges ``(i, j)``, ``i < j``, that sort k rows: Batcher's odd-even merge sort
    on the power of two at or above k, less those that reach row k or beyond. Rows past k would
    hold +inf, which a compare-exchange with a real row never moves, so the rest sorts the k rows.
    14 rows take 53 compare-exchanges, where odd-even transposition takes k (k - 1) / 2 = 91."""
    size = 1 << max(0, k - 1).bit_length()
    pairs = []
    p = 1
    while p < size:
        step = p
        while step >= 1:
            for j in range(step % p, size - step, 2 * step):
                for i in range(min(step, size - j - step)):
                    if (i + j) // (2 * p) == (i + j + step) // (2 * p) and i + j + step < k:
                        pairs.append((i + j, i + j + step))
            step //= 2
        p *= 2
    return tuple(pairs)


def sorted_rows(values: torch.Tensor) -> torch.Tensor:
    """``values.sort(dim=0).values``. For up to 128 rows (24 off a CPU), by a sorting network of
    elementwise minima and maxima (``sorting_network``) over blocks of 16,384 columns: torch.sort
    along a short first dimension is several times slower on a CPU, a network over whole rows goes
    through memory at each of its steps, and in blocks each compare-exchange costs about its call,
    so the fewer the better (benchmarks/bench_aggregation.py). A comparison network puts the same
    values in the same places. On a CPU, a process that sorts many stacks of one height compiles
    its network (``compiled_network``)."""
    k = values.shape[0]
    if k > (_NETWORK_ROWS if values.device.type == "cpu" else _NETWORK_ROWS_ELSEWHERE):
        return values.sort(dim=0).values
    shape, values = values.shape, values.reshape(k, -1)  # a [k] or [k, ...] stack as [k, columns]
    timed = values.device.type == "cpu" and values.shape[1] >= _NETWORK_COLUMNS and k <= _COMPILED_ROWS
    if timed and (k in _compiled or _eager_seconds[k] >= _COMPILE_AFTER_S):
        ordered = compiled_network(k, values)
        if ordered is not None:
            return ordered.view(shape)
    began = time.perf_counter()
    ordered = network_sorted(values)
    if timed:
        _eager_seconds[k] += time.perf_counter() - began
    return ordered.view(shape)


def network_sorted(values: torch.Tensor) -> torch.Tensor:
    """A ``[k, columns]`` stack sorted along the rows by the (uncompiled) network, in blocks of columns."""
    out, sort = torch.empty_like(values), network_of(values.shape[0])
    # a GPU has no such cache to keep, and each block would cost it the network's kernel launches again
    width = _NETWORK_COLUMNS if values.device.type == "cpu" else max(1, values.shape[1])
    for start in range(0, values.shape[1], width):
        torch.stack(sort(values[:, start : start + width]), out=out[:, start : start + width])
    return out


def network_of(k: int) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """The sorting network of k rows as a function of a ``[k, columns]`` stack, giving its rows sorted."""
    network = sorting_network(k)

    def sort(values: torch.Tensor) -> list[torch.Tensor]:
        rows = list(values.unbind(0))
        for i, j in network:
            rows[i], rows[j] = torch.minimum(rows[i], rows[j]), torch.maximum(rows[i], rows[j])
        return rows

    return sort


# Compiled, the network loads each column's k values once and keeps them in registers, where the
# eager one goes through the block at every compare-exchange: 2.7 to 4.9 times as fast up to 16 rows,
# 1.5 at 24 and hardly faster beyond, on the 2-core CPU of benchmarks/bench_aggregation.py --sort.
_COMPILED_ROWS = 24
# A compile takes 3 to 11 s there (less once torch has cached it on disk). Compiling once eager
# sorts of that height have taken as long never costs more than about twice the better choice
# in hindsight, and a short run never compiles at all.
_COMPILE_AFTER_S = 5.0
_eager_seconds: collections.defaultdict[int, float] = collections.defaultdict(float)
_compiled: dict[int, Callable[[torch.Tensor], torch.Tensor] | None] = {}


def compiled_network(k: int, values: torch.Tensor) -> torch.Tensor | None:
    """``values`` ``[k, columns]`` sorted along the rows by the network compiled into one loop over
    the columns (torch.compile), or None where it cannot be compiled, which is said once. Minima and
    maxima are exact, so it gives the eager network's bits (NaN, infinities and signed zeros
    included), and a run gives the same results whenever it compiles or whether it can."""
    if k not in _compiled:
        sort = network_of(k)
        # torch's C++ builder would print "No CUDA runtime is found" into the run's output: not for a CPU kernel
        cuda_note = logging.getLogger("torch.utils.cpp_extension")
        level = cuda_note.level
        cuda_note.setLevel(logging.ERROR)
        try:
            # compiled in this process: inductor's pool of compiling processes would outlive a killed run
            compiled = torch.compile(lambda rows: torch.stack(sort(rows)), dynamic=True, options={"compile_threads": 1})
            ordered = compiled(values.contiguous())
        except Exception as error:  # no C++ compiler, or a Python or torch that cannot compile here
            reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            logger.warning(f"the sorting network of {k} rows could not be compiled ({reason}); it runs uncompiled")
            _compiled[k] = None
            return None
        finally:
            cuda_note.setLevel(level)
        _compiled[k] = compiled
        return ordered
    compiled = _compiled[k]
    return None if compiled is None else compiled(values.contiguous())


def middle(values: torch.Tensor) -> torch.Tensor:
    """Median along dim 0 from one sort; for even k, the mean of the two middle values."""
    k = values.shape[0]
    ordered = sorted_rows(values)
    return ordered[(k - 1) // 2] / 2 + ordered[k // 2] / 2  # halves first: no overflow near the float limit


def centred_gram(rows: torch.Tensor) -> torch.Tensor:
    """``(X - mean) (X - mean)^T`` of the rows, in float64."""
    return gram(rows, rows.to(torch.float64).mean(dim=0))


def squared_distances(updates: torch.Tensor) -> torch.Tensor:
    """``[k, k]`` squared Euclidean distances between the rows, via the Gram matrix.

    ``||a - b||^2 = ||a||^2 + ||b||^2 - 2 <a, b>`` costs one ``[k, P] x [P, k]`` product
    instead of k^2 row differences (far fewer passes over the stack). Its
    weakness is cancellation: the rounding error of ``<a, b>`` scales with ``||a|| ||b||``,
    so it swamps the distance between updates that are close compared to their length, and
    its size depends on the BLAS's summation order, so on the machine. Distances do not
    change under translation, so the rows are first moved by a centre among them: the
    inner products are then the size of the rows' spread around it rather than of their
    length, and the error is at most about P * 1e-16 times that spread squared, in any
    summation order. The centre is the mean of the rows no longer than twice the median
    norm: a plain mean would be dragged far off by one huge update, and the honest rows'
    distances, which Krum exists to compare, would be lost in the cancellation again. The
    work is in float64 (which holds float32 inputs exactly), in column blocks so that the
    float64 copy stays small. Each pair's distance is computed once and mirrored: the BLAS may
    round ``<a, b>`` and ``<b, a>`` apart, and d(i, j) != d(j, i) would then decide exact ties
    (Bulyan's last picks always hold one). The diagonal is exactly 0.
    """
    norms = row_norms(updates)
    typical = (norms <= 2 * norms.median()).to(updates.dtype)
    inner = gram(updates, combine(typical / typical.sum(), updates).to(torch.float64))
    squared = inner.diagonal()
    upper = (squared[:, None] + squared[None, :] - 2 * inner).clamp_(min=0).triu_(1)
    return upper + upper.T  # x + 0 is exact: both triangles hold the same values


def assumed_attackers(rule: str, needs: str, k: int, f: int | None, largest: int) -> int:
    """``f``, or the ``largest`` number of attackers that ``rule`` allows among ``k`` clients."""
    if largest < 0:
        too_few(f"{rule} needs {needs} clients per round, so at least 3; got k = {k}")
    if f is None:
        return largest
    if f > largest:
        too_few(
            f"f = {f} is too large for k = {k} clients per round: {rule} needs {needs}, "
            f"so aggregator_options.f must be in [0, {largest}]"
        )
    return f


def first_lowest(scores: torch.Tensor) -> torch.Tensor:
    """The index of the lowest score, the lowest index among equal ones: a stable sort states that
    rule on any device, where ``argmin`` leaves it to the reduction's order."""
    return scores.sort(stable=True).indices[0]


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
