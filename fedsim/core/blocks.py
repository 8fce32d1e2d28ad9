"""float64 arithmetic over a stack of float32 rows ([k, P]), a block of columns at a time, so that
a float64 copy of the whole stack never exists: the norms of the rows and their Gram matrix, which
the robust rules (fl/aggregation), the privacy accounting and the clustered algorithms read."""

from __future__ import annotations

from collections.abc import Iterator

import torch

_BLOCK = 1 << 16  # elements of the float64 block in ``float64_blocks``: 512 KiB, kept in cache through its passes
_BLOCK_ELSEWHERE = 1 << 20  # 8 MiB on a GPU, which has no such cache to keep and pays its kernel launches per block


def float64_blocks(rows: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """``(start, block)`` over the columns of ``rows``: each block of columns copied in turn into
    one float64 buffer of a fixed size, so that a float64 view of a large stack never
    exists whole (the buffer is reused: use a block before taking the next)."""
    k, p = rows.shape
    size = _BLOCK if rows.device.type == "cpu" else _BLOCK_ELSEWHERE
    columns = max(1, min(p, size // max(1, k)))
    buffer = rows.new_empty((k, columns), dtype=torch.float64)
    for start in range(0, p, columns):
        block = buffer[:, : min(columns, p - start)]
        block.copy_(rows[:, start : start + columns])
        yield start, block


def row_norms(rows: torch.Tensor, point: torch.Tensor | None = None) -> torch.Tensor:
    """The ``[k]`` Euclidean norms of ``rows[i] - point`` (``point`` default 0), in float64.

    In float32 a sum of squares overflows once an entry passes 1.8e19, and an infinite norm
    then gives 0 / 0 or inf / inf = NaN downstream. Float64 holds the difference of two float32
    values to ~1e-16 and a sum of P squares of them up to (6.8e38)^2 P ~ 5e77 P. The work is in
    column blocks (``float64_blocks``), so that the float64 copy stays small; the norm of a row
    is the norm of its blocks' norms.
    """
    point = None if point is None else point.to(torch.float64)
    parts = []
    for start, block in float64_blocks(rows):
        if point is not None:
            block -= point[start : start + block.shape[1]]
        parts.append(torch.linalg.vector_norm(block, dim=1))
    return torch.linalg.vector_norm(torch.stack(parts), dim=0)


def finite_rows(rows: torch.Tensor) -> torch.Tensor:
    """``[k]`` bool: which rows hold no NaN or Inf. A float32 (or narrower) row is finite exactly
    when its float64 norm is: the squares cannot overflow a float64 sum (see ``row_norms``), and a
    NaN or an Inf carries through it. That costs a tenth of ``torch.isfinite(rows).all(dim=1)`` on
    a CPU, which writes a bool per value. A float64 row, whose norm could overflow, is checked
    value by value."""
    if not rows.is_floating_point():
        return torch.ones(len(rows), dtype=torch.bool, device=rows.device)
    if rows.dtype == torch.float64 or not rows.shape[1]:
        return torch.isfinite(rows).all(dim=1)
    return torch.isfinite(row_norms(rows))


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (any shape) holds no NaN or Inf, read as one row (``finite_rows``)."""
    return bool(finite_rows(tensor.reshape(1, -1))[0])


def gram(rows: torch.Tensor, centre: torch.Tensor | None = None) -> torch.Tensor:
    """``(X - centre) (X - centre)^T`` of the rows (``centre`` default 0), in float64 (column blocks:
    no float64 copy of the whole stack)."""
    out = torch.zeros(len(rows), len(rows), dtype=torch.float64, device=rows.device)
    for start, block in float64_blocks(rows):
        if centre is not None:
            block -= centre[start : start + block.shape[1]]
        out.addmm_(block, block.T)
    return out


def span_coordinates(rows: torch.Tensor) -> torch.Tensor:
    """``[k, k]`` float64: the rows' coordinates in an orthonormal basis of their span, ``C`` with
    ``C C^T = rows rows^T``, from the eigendecomposition of their Gram matrix ``V diag(l) V^T`` as
    ``V diag(sqrt(l))`` (the basis, never formed, is ``diag(1 / sqrt(l)) V^T rows``). Lengths,
    distances and angles between combinations of the rows are the same in coordinates, up to the
    rounding of the Gram matrix; the rounding's negative eigenvalues of a rank-deficient stack are
    taken as 0."""
    values, vectors = torch.linalg.eigh(gram(rows))
    return vectors * values.clamp(min=0).sqrt()


def span_basis(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' coordinates ``C`` (``[k, r]``, float64, as ``span_coordinates``) and the basis
    ``B`` (``[r, P]``, the rows' dtype, at least float32) they refer to, ``C B = rows`` up to
    rounding. Directions whose eigenvalue of the Gram matrix is within its rounding (k float64
    epsilons of the largest) are left out: a rank-deficient stack has less than 1e-7 of its largest
    singular value there. ``B = diag(1 / sqrt(l)) V^T rows`` is computed in the rows' precision;
    its error along a direction of small ``l`` is large, but ``C`` weighs that direction by
    ``sqrt(l)``, so ``C B`` (and any combination ``A C B``) is as exact as a product of the rows in
    that precision."""
    values, vectors = torch.linalg.eigh(gram(rows))
    kept = values > len(rows) * torch.finfo(torch.float64).eps * values[-1]
    roots, vectors = values[kept].sqrt(), vectors[:, kept]
    dtype = torch.promote_types(rows.dtype, torch.float32)
    basis = (vectors / roots).T.to(dtype) @ rows.to(dtype)
    return vectors * roots, basis


def cosine_similarities(rows: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``[k, k]`` float64: the cosine of every pair of the rows, from their Gram matrix, each norm
    taken as at least ``eps`` (a zero row's cosine is 0 with every row)."""
    inner = gram(rows)
    norms = inner.diagonal().sqrt().clamp(min=eps)
    return inner / norms[:, None] / norms[None, :]
