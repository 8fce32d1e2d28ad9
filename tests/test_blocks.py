"""core/blocks: float64 arithmetic over rows of float32, a block of columns at a time."""

import pytest
import torch

from fedsim.core import blocks
from fedsim.core.blocks import (
    all_finite,
    cosine_similarities,
    finite_rows,
    gram,
    row_norms,
    span_basis,
    span_coordinates,
)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few columns, so that a small stack crosses many of them (and a ragged last one)."""
    monkeypatch.setattr(blocks, "_BLOCK", 14)


def rows_with_bad_values(dtype=torch.float32) -> torch.Tensor:
    """Rows of the largest float32 values (whose squares overflow float32), with a NaN, an Inf or a
    -Inf in some of them at the first, a middle or the last column."""
    torch.manual_seed(0)
    rows = torch.randn(9, 37) * 3e38
    rows.clamp_(-3.3e38, 3.3e38)  # within bfloat16's range too
    rows[1, 0], rows[3, 18], rows[5, 36], rows[7, 2], rows[7, 30] = float("nan"), float("inf"), -float("inf"), 1, 2
    rows[8, 10] = float("nan")
    rows[8, 11] = float("inf")
    return rows.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_finite_rows_are_the_rows_without_nan_or_inf(small_blocks, dtype):
    rows = rows_with_bad_values(dtype)
    assert finite_rows(rows).tolist() == torch.isfinite(rows).all(dim=1).tolist()
    if dtype != torch.float16:  # whose largest value is 65504: every row above holds an Inf
        assert finite_rows(rows).tolist() == [True, False, True, False, True, False, True, True, False]


def test_a_float64_row_of_huge_finite_values_is_finite():
    """Its norm overflows float64, so it is read value by value."""
    rows = torch.full((2, 5), 1e300, dtype=torch.float64)
    rows[1, 4] = float("nan")
    assert finite_rows(rows).tolist() == [True, False]


def test_integer_and_empty_rows_are_finite():
    assert finite_rows(torch.arange(6).reshape(2, 3)).tolist() == [True, True]
    assert finite_rows(torch.empty(3, 0)).tolist() == [True, True, True]
    assert all_finite(torch.empty(0)) and all_finite(torch.tensor(2.0)) and all_finite(torch.arange(4))


def test_all_finite_reads_any_shape(small_blocks):
    rows = rows_with_bad_values()
    assert not all_finite(rows) and all_finite(rows[[0, 2, 4, 6]])
    assert not all_finite(rows[[0, 8]].T)  # not contiguous
    assert all_finite(rows[0].reshape(1, 37, 1))


def test_row_norms_and_gram_against_float64(small_blocks):
    """In float64 from the start; float32 would overflow in the squares of these rows."""
    torch.manual_seed(1)
    rows = torch.randn(5, 37) * 1e30
    point = torch.randn(37) * 1e30
    exact = rows.double()
    torch.testing.assert_close(row_norms(rows), torch.linalg.vector_norm(exact, dim=1), rtol=1e-14, atol=0)
    torch.testing.assert_close(
        row_norms(rows, point), torch.linalg.vector_norm(exact - point.double(), dim=1), rtol=1e-14, atol=0
    )
    torch.testing.assert_close(gram(rows), exact @ exact.T, rtol=1e-14, atol=0)
    centred = exact - point.double()
    torch.testing.assert_close(gram(rows, point.double()), centred @ centred.T, rtol=1e-14, atol=0)
    norms = torch.linalg.vector_norm(exact, dim=1)
    torch.testing.assert_close(cosine_similarities(rows), exact @ exact.T / norms[:, None] / norms, rtol=1e-14, atol=0)


def test_span_coordinates_keep_every_length_and_angle_of_combinations_of_the_rows(small_blocks):
    """``C C^T`` is the Gram matrix, so any combination ``A rows`` has the lengths and inner products
    of ``A C``; the last row is a combination of the others (rank 6 of 7), where rounding makes an
    eigenvalue negative. The error is the eigendecomposition's: a few units of float64 rounding of
    the largest eigenvalue, bounded here by 1e-12 of it."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 1000, generator=g) * torch.linspace(0.1, 10, 6)[:, None]
    rows = torch.cat([rows, (rows[0] - 2 * rows[3])[None]])
    coordinates = span_coordinates(rows)
    assert coordinates.shape == (7, 7) and coordinates.dtype == torch.float64 and all_finite(coordinates)
    exact = rows.double()
    scale = float(torch.linalg.eigvalsh(exact @ exact.T)[-1])
    torch.testing.assert_close(coordinates @ coordinates.T, exact @ exact.T, rtol=0, atol=1e-12 * scale)
    mixing = torch.randn(4, 7, generator=g, dtype=torch.float64)
    full, reduced = mixing @ exact, mixing @ coordinates
    torch.testing.assert_close(reduced @ reduced.T, full @ full.T, rtol=0, atol=1e-12 * scale * 49 * 16)


@pytest.mark.parametrize("rank_deficient", [False, True])
def test_span_basis_gives_back_the_rows_and_their_combinations(small_blocks, rank_deficient):
    """``C B`` is the rows, and ``A C B`` the combination ``A rows``, to float32 rounding: the error
    of a float32 product of k = 7 terms of the rows, a few float32 epsilons of the largest value
    (bounded here by 8 k eps). Numerically null directions (the last row a combination of the
    others, or a zero row) are left out; the others are orthonormal up to the rounding of the rows
    divided by the square root of their eigenvalue."""
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(7, 1000, generator=g) * torch.linspace(0.1, 10, 7)[:, None]
    if rank_deficient:
        rows[5] = rows[0] - 2 * rows[3]
        rows[6] = 0
    coordinates, basis = span_basis(rows)
    rank = 5 if rank_deficient else 7
    assert coordinates.shape == (7, rank) and coordinates.dtype == torch.float64
    assert basis.shape == (rank, 1000) and basis.dtype == torch.float32
    bound = 8 * 7 * torch.finfo(torch.float32).eps * float(rows.abs().max())
    torch.testing.assert_close(coordinates.float() @ basis, rows, rtol=0, atol=bound)
    mixing = torch.rand(4, 7, generator=g)
    mixing /= mixing.sum(dim=1, keepdim=True)  # convex combinations, as NNM and bucketing make
    torch.testing.assert_close((mixing.double() @ coordinates).float() @ basis, mixing @ rows, rtol=0, atol=bound)
    exact = rows.double()
    values = torch.linalg.eigvalsh(exact @ exact.T)
    torch.testing.assert_close(coordinates @ coordinates.T, exact @ exact.T, rtol=0, atol=1e-12 * float(values[-1]))
    if not rank_deficient:  # a basis vector's error grows as 1 / sqrt(l): its rows' rounding, divided by it
        spread = float((values[-1] / values[0]).sqrt())
        atol = 8 * 7 * torch.finfo(torch.float32).eps * spread
        torch.testing.assert_close(basis @ basis.T, torch.eye(7), rtol=0, atol=atol)


def test_span_basis_of_zero_rows_is_empty():
    coordinates, basis = span_basis(torch.zeros(3, 10))
    assert coordinates.shape == (3, 0) and basis.shape == (0, 10)
    assert torch.equal(coordinates.float() @ basis, torch.zeros(3, 10))
