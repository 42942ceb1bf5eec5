"""Tests of `krylov_readout` and `polynomial_action`.

Values and derivatives (VJP and JVP) are compared with the materialising path (on a
grid and on random problems),
`C @ krylov(...)` and a `tensordot` with `krylov(...)`, differentiated by plain
autodiff (`adjoint="autodiff"`), in float64; then against finite differences and a
closed form on a diagonal matrix. The compiled memory of the reverse pass shows
that the readout's own rule runs (autodiff through its loops would keep every
vector).
"""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    KINDS,
    check_finite_differences,
    make_operator,
    random_array,
    random_like,
    random_matrix,
    temp_bytes,
    unchecked,
    value_vjp_jvp,
)
from hypothesis import given, settings, strategies as st
from jax.experimental import sparse

import krylovjax

N = 6
BASES = {
    "monomial": None,
    "chebyshev": lambda p: krylovjax.Chebyshev(p["lo"], p["hi"]),
    "three_term": lambda p: krylovjax.ThreeTerm(p["a"], p["b"], p["c"]),
}


def _basis_params(d, dtype=jnp.float64):
    """The differentiable arrays of each basis at depth `d`."""
    return {
        "lo": jnp.asarray(-1.3, dtype),
        "hi": jnp.asarray(1.1, dtype),
        "a": jnp.linspace(0.9, 1.2, d).astype(dtype),
        "b": jnp.linspace(-0.1, 0.1, d).astype(dtype),
        "c": jnp.linspace(0.2, 0.4, d).astype(dtype),
    }


def _both_paths(kind, basis, d, checkpoints, C_form="dense"):
    """`(readout, materialised)`: two functions of `(params, x0, C, coeffs,
    basis_params)` returning `(krylov_readout(...), polynomial_action(...))`, the
    second through `krylov` and plain autodiff."""
    make = BASES[basis]

    def build_C(C):
        if C_form == "callable":
            return lambda x: jnp.tensordot(C, x, 1)
        return C

    def readout(build, params, x0, C, coeffs, bp):
        A = build(params)
        b = None if make is None else make(bp)
        y = krylovjax.krylov_readout(
            A, x0, d, build_C(C), basis=b, checkpoints=checkpoints
        )
        z = krylovjax.polynomial_action(A, x0, coeffs, basis=b, checkpoints=checkpoints)
        return y, z

    def materialised(build, params, x0, C, coeffs, bp):
        A = build(params)
        b = None if make is None else make(bp)
        X = krylovjax.krylov(A, x0, d, basis=b, adjoint="autodiff")
        y = jnp.tensordot(C, X, 1)
        rows = jnp.moveaxis(X, 1, 0)
        if coeffs.ndim == 1:
            z = jnp.tensordot(coeffs, rows, 1)
        else:
            z = jnp.einsum("knb,kbc->nc", rows, coeffs)
        return y, z

    return readout, materialised


def _compare(kind, basis, d, checkpoints, block=None, mixing=False, seed=0, **kw):
    """Values, VJPs and JVPs of both paths at one random point, in one program."""
    keys = jr.split(jr.key(seed), 8)
    A = random_matrix(keys[0], N, jnp.float64)
    params, build = make_operator(kind, A)
    shape = (N,) if block is None else (N, block)
    x0 = random_array(keys[1], shape, jnp.float64)
    C = random_array(keys[2], (3, N), jnp.float64)
    coeffs_shape = (d, block, 2) if mixing else (d,)
    coeffs = random_array(keys[3], coeffs_shape, jnp.float64)
    bp = _basis_params(d)
    args = (params, x0, C, coeffs, bp)
    readout, materialised = _both_paths(kind, basis, d, checkpoints, **kw)
    out = jax.eval_shape(lambda *a: materialised(build, *a), *args)
    ct = random_like(keys[4], out)
    tangents = random_like(keys[5], args)

    @jax.jit
    def run(args, tangents, ct):
        return [
            value_vjp_jvp(lambda *a, f=f: f(build, *a), args, tangents, ct)
            for f in (readout, materialised)
        ]

    got, want = run(args, tangents, ct)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        scale = max(1.0, float(jnp.max(jnp.abs(w))))
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12 * scale)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("basis", list(BASES))
def test_matches_materialising_path(kind, basis):
    # d = 11 (a prime) with 2 vectors kept: a checkpoint every 6 vectors and one
    # spare vector for the binomial schedule of each segment (6, then 5).
    block = 2 if basis == "chebyshev" else None
    _compare(kind, basis, d=11, checkpoints=2, block=block)


@pytest.mark.parametrize(
    ("kind", "d", "checkpoints"),
    [
        ("dense", 1, None),
        ("dense", 2, None),
        ("dense", 2, 0),
        # Checkpoints every 2 vectors, each segment recomputed into a buffer.
        ("dense", 7, 4),
        # Only x0 kept: every vector recomputed from it, d (d - 1) / 2 products.
        ("dense", 9, 0),
        ("dense", 9, 40),
        # All 20 vectors stored, their pairings in chunks of 8 steps and one of 4.
        ("bcoo", 20, None),
        ("bcoo", 20, 19),
    ],
)
def test_depths_and_checkpoints(kind, d, checkpoints):
    _compare(kind, "three_term", d, checkpoints)


@settings(max_examples=5, deadline=None)
@given(
    kind=st.sampled_from(["dense", "bcoo", "closure"]),
    basis=st.sampled_from(list(BASES)),
    d=st.integers(1, 12),
    checkpoints=st.one_of(st.none(), st.integers(0, 13)),
    block=st.one_of(st.none(), st.integers(1, 3)),
    seed=st.integers(0, 2**16),
)
def test_random_problems_match_materialising_path(
    kind, basis, d, checkpoints, block, seed
):
    _compare(kind, basis, d, checkpoints, block=block, seed=seed)


def test_mixing_coefficients_and_callable_readout():
    # `(d, b_in, b_out)` coefficients on a block, and `C` as a linear callable.
    _compare("bcoo", "chebyshev", 5, 2, block=3, mixing=True, C_form="callable")


def _value_and_grads(readout, materialised, args):
    """Pairs of leaves of both losses' values and gradients in all of `args`, in
    one program."""
    got, want = jax.jit(
        lambda a: [
            jax.value_and_grad(f, argnums=tuple(range(len(a))))(*a)
            for f in (readout, materialised)
        ]
    )(args)
    return zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)


def test_long_dense_sequence_in_chunks():
    # n = 520, d = 509 (every vector stored): the reverse pass takes chunks of
    # 504 steps (the top one 5) and sums each chunk's gradient of the dense matrix
    # in blocks of rows.
    n, d = 520, 509
    keys = jr.split(jr.key(3), 4)
    A = random_matrix(keys[0], n, jnp.float64) / 2
    x0 = random_array(keys[1], (n,), jnp.float64)
    C = random_array(keys[2], (2, n), jnp.float64)
    coeffs = random_array(keys[3], (d,), jnp.float64)

    def readout(A, x0, C, coeffs):
        y = krylovjax.krylov_readout(A, x0, d, C)
        z = krylovjax.polynomial_action(A, x0, coeffs)
        return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.sin(z))

    def materialised(A, x0, C, coeffs):
        X = krylovjax.krylov(A, x0, d, adjoint="autodiff")
        return jnp.sum(jnp.sin(C @ X)) + jnp.sum(jnp.sin(X @ coeffs))

    for g, w in _value_and_grads(readout, materialised, (A, x0, C, coeffs)):
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12 * scale)


def test_long_sequence():
    # d = 10^4, n = 4, every vector stored (the default at this size).
    d = 10_000
    A = jnp.diag(jnp.array([0.999, -0.5, 0.3, 0.9995]))
    x0 = jnp.array([1.0, 2.0, -1.0, 0.5])
    C = jnp.array([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, -1.0]])
    coeffs = jnp.cos(jnp.arange(d, dtype=jnp.float64) / 100)
    basis = krylovjax.Chebyshev(-1.0, 1.0)

    def readout(A, x0, C, coeffs):
        y = krylovjax.krylov_readout(A, x0, d, C, basis=basis)
        z = krylovjax.polynomial_action(A, x0, coeffs, basis=basis)
        return jnp.sum(jnp.sin(y)) + jnp.sum(z**2)

    def materialised(A, x0, C, coeffs):
        X = krylovjax.krylov(A, x0, d, basis=basis, adjoint="autodiff")
        return jnp.sum(jnp.sin(C @ X)) + jnp.sum((X @ coeffs) ** 2)

    for g, w in _value_and_grads(readout, materialised, (A, x0, C, coeffs)):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9)


def test_complex():
    key_a, key_x, key_c = jr.split(jr.key(1), 3)
    A = random_matrix(key_a, N, jnp.complex128)
    x0 = random_array(key_x, (N,), jnp.complex128)
    C = random_array(key_c, (2, N), jnp.complex128)
    coeffs = jnp.array([1.0, 0.5j, -0.25, 0.1 + 0.2j])

    def loss(f):
        return lambda A, x0, C, coeffs: jnp.sum(jnp.abs(f(A, x0, C, coeffs)) ** 2)

    def readout(A, x0, C, coeffs):
        y = krylovjax.krylov_readout(A, x0, 4, C, checkpoints=1)
        z = krylovjax.polynomial_action(A, x0, coeffs, checkpoints=0)
        return jnp.concatenate([y.ravel(), z])

    def materialised(A, x0, C, coeffs):
        X = krylovjax.krylov(A, x0, 4, adjoint="autodiff")
        return jnp.concatenate([(C @ X).ravel(), X @ coeffs])

    args = (A, x0, C, coeffs)
    for got, want in zip(
        jax.grad(loss(readout), argnums=(0, 1, 2, 3))(*args),
        jax.grad(loss(materialised), argnums=(0, 1, 2, 3))(*args),
        strict=True,
    ):
        assert got.dtype == jnp.complex128
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_finite_differences_and_second_order():
    key_a, key_x, key_c = jr.split(jr.key(2), 3)
    A = random_matrix(key_a, 5, jnp.float64)
    x0 = random_array(key_x, (5,), jnp.float64)
    C = random_array(key_c, (2, 5), jnp.float64)
    coeffs = jnp.array([0.5, -1.0, 0.25, 2.0, 0.1, -0.3])
    lo, hi = jnp.asarray(-1.5, jnp.float64), jnp.asarray(1.2, jnp.float64)

    def f(A, x0, C, coeffs, lo, hi):
        basis = krylovjax.Chebyshev(lo, hi)
        y = krylovjax.krylov_readout(A, x0, 6, C, basis=basis, checkpoints=2)
        z = krylovjax.polynomial_action(A, x0, coeffs, basis=basis)
        return jnp.concatenate([jnp.sin(y).ravel(), z])

    args = (A, x0, C, coeffs, lo, hi)
    check_finite_differences(
        f,
        jax.jit(lambda *a: value_vjp_jvp(f, *a)),
        args,
        eps=1e-6,
        atol=1e-6,
        rtol=1e-6,
    )

    # Second order: the Hessian in the coefficients and A, forward over reverse.
    def loss(f):
        return lambda coeffs, A: jnp.sum(f(A, x0, C, coeffs, lo, hi) ** 3)

    def g(A, x0, C, coeffs, lo, hi):
        X = krylovjax.krylov(A, x0, 6, basis=krylovjax.Chebyshev(lo, hi))
        return jnp.concatenate([jnp.sin(C @ X).ravel(), X @ coeffs])

    got = jax.jit(jax.hessian(loss(f), argnums=(0, 1)))(coeffs, A)
    want = jax.jit(jax.hessian(loss(g), argnums=(0, 1)))(coeffs, A)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


def test_closed_form_on_a_diagonal_matrix():
    # On A = diag(lam), sum_k theta_k T_k(A) x0 is chebval(lam, theta) * x0, with
    # derivative chebval(lam, chebder(theta)) * x0 in lam, T_k(lam) * x0 in theta_k.
    lam = np.array([-0.9, -0.2, 0.4, 0.95])
    x0 = np.array([1.0, -2.0, 0.5, 3.0])
    theta = np.array([0.3, -1.0, 0.5, 0.25, -0.125])
    basis = krylovjax.Chebyshev(-1.0, 1.0)

    def total(lam, theta):
        y = krylovjax.polynomial_action(jnp.diag(lam), x0, theta, basis=basis)
        return jnp.sum(y)

    value, (d_lam, d_theta) = jax.value_and_grad(total, argnums=(0, 1))(lam, theta)
    cheb = np.polynomial.chebyshev
    np.testing.assert_allclose(value, np.sum(cheb.chebval(lam, theta) * x0), rtol=1e-13)
    np.testing.assert_allclose(
        d_lam, cheb.chebval(lam, cheb.chebder(theta)) * x0, rtol=1e-12
    )
    T = cheb.chebvander(lam, len(theta) - 1)  # (4, d): T_k(lam_i)
    np.testing.assert_allclose(d_theta, T.T @ x0, rtol=1e-12)


def test_vmap():
    keys = jr.split(jr.key(3), 4)
    As = jax.vmap(lambda k: random_matrix(k, N, jnp.float64))(jr.split(keys[0], 3))
    x0s = random_array(keys[1], (3, N), jnp.float64)
    C = random_array(keys[2], (2, N), jnp.float64)
    coeffs = random_array(keys[3], (3, 5), jnp.float64)

    def readout(A, x0, coeffs):
        y = krylovjax.krylov_readout(A, x0, 5, C, checkpoints=1)
        return y, krylovjax.polynomial_action(A, x0, coeffs, checkpoints=2)

    def materialised(A, x0, coeffs):
        X = krylovjax.krylov(A, x0, 5, adjoint="autodiff")
        return C @ X, X @ coeffs

    def grads(f):
        return jax.grad(lambda *a: sum(jnp.sum(jnp.sin(y)) for y in f(*a)), (0, 1, 2))

    for axes in [(0, 0, 0), (None, 0, None), (0, None, 0)]:
        args = [
            v if ax == 0 else v[0]
            for v, ax in zip((As, x0s, coeffs), axes, strict=True)
        ]
        got = jax.vmap(grads(readout), in_axes=axes)(*args)
        want = jax.vmap(grads(materialised), in_axes=axes)(*args)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_sparse_readout_matrix_and_rows_layout():
    A = jnp.diag(jnp.array([0.5, -0.5, 0.25]))
    x0 = jnp.array([1.0, 1.0, 1.0])
    C = jnp.array([[1.0, 0.0, 2.0], [0.0, 0.0, 1.0]])
    want = C @ krylovjax.krylov(A, x0, 4)
    Cs = sparse.BCOO.fromdense(C)
    got = krylovjax.krylov_readout(A, x0, 4, Cs)
    np.testing.assert_allclose(got, want, rtol=1e-15)

    # The gradient of a BCOO readout's stored values: the dense gradient there.
    def loss(data):
        C = sparse.BCOO((data, Cs.indices), shape=Cs.shape)
        return jnp.sum(jnp.sin(krylovjax.krylov_readout(A, x0, 4, C)))

    dense = jax.grad(lambda C: jnp.sum(jnp.sin(C @ krylovjax.krylov(A, x0, 4))))(C)
    rows, cols = np.asarray(Cs.indices).T
    np.testing.assert_allclose(jax.grad(loss)(Cs.data), dense[rows, cols], rtol=1e-14)
    rows = krylovjax.krylov_readout(A, x0, 4, C, layout="rows")
    np.testing.assert_allclose(rows, want.T, rtol=1e-15)
    # A float32 matrix with a float64 readout promotes.
    got = krylovjax.krylov_readout(A.astype(jnp.float32), x0.astype(jnp.float32), 4, C)
    assert got.dtype == jnp.float64


def test_matrix_readout_of_arrays_reads_their_first_axis():
    """For a callable `A` on `(n, n, 2)` arrays, a `(p, n)` matrix `C`, dense or
    BCOO, contracts each vector's first axis, as for a block (`C @ x` alone
    contracted axis -2: a wrong value when that axis was n long too)."""
    rng = np.random.default_rng(0)
    M = jnp.asarray(rng.normal(size=(3, 3))) / 2
    x0 = jnp.asarray(rng.normal(size=(3, 3, 2)))
    C = jnp.asarray(rng.normal(size=(4, 3)))

    def A(v):
        return jnp.einsum("ij,j...->i...", M, v)

    want = jnp.einsum("pn,nd...->pd...", C, krylovjax.krylov(A, x0, 5))
    for readout in (C, sparse.BCOO.fromdense(C)):
        got = krylovjax.krylov_readout(A, x0, 5, readout)
        np.testing.assert_allclose(got, want, rtol=1e-13)


def test_reverse_pass_memory():
    # The d vectors take 512 MiB, so by default the reverse pass keeps
    # 2 sqrt(d) - 1 = 31 of them: checkpoints every 13 vectors and a segment's,
    # where the materialising path keeps d. (Compiled only: nothing is
    # allocated.)
    n, d = 2**19, 256
    A = jax.ShapeDtypeStruct((n,), jnp.float32)
    x0 = jax.ShapeDtypeStruct((n,), jnp.float32)
    coeffs = jax.ShapeDtypeStruct((d,), jnp.float32)

    def op(a):
        return lambda x: a * x + jnp.roll(x, 1)

    def readout(a, x0, coeffs):
        return jnp.sum(krylovjax.polynomial_action(op(a), x0, coeffs) ** 2)

    def materialised(a, x0, coeffs):
        X = krylovjax.krylov(op(a), x0, d)
        return jnp.sum((X @ coeffs) ** 2)

    vector = n * 4
    got = temp_bytes(jax.grad(readout, (0, 1, 2)), A, x0, coeffs)
    want = temp_bytes(jax.grad(materialised, (0, 1, 2)), A, x0, coeffs)
    assert want > d * vector
    assert got < (3 * 16 + 8) * vector, (got / vector, want / vector)


def test_recomputing_from_x0_holds_no_schedule():
    """`checkpoints=0` recomputes each vector from `x0`: d (d - 1) / 2 products in
    about d^2 / 2 actions, which the loop works out as it goes. Their table, a
    constant of the program, took 4 MB of its peak memory at d = 1000 (of
    two-number vectors). Compiled only."""
    d = 1000
    A = jax.ShapeDtypeStruct((2, 2), jnp.float32)
    x0 = jnp.ones(2, jnp.float32)

    def loss(A):
        return jnp.sum(krylovjax.krylov_readout(A, x0, d, x0[None], checkpoints=0))

    stats = jax.jit(jax.grad(loss)).lower(A).compile().memory_analysis()
    if stats is None:
        pytest.skip("memory_analysis() returns None on this backend")
    assert stats.peak_memory_in_bytes < 100 * 2**10, stats.peak_memory_in_bytes


def test_reverse_pass_memory_of_huge_vectors():
    # Vectors of 256 MiB at d = 16: by default the reverse pass keeps two of them
    # (a checkpoint and a spare one for the binomial schedule) besides its working
    # vectors, where storing all would keep 16. (Compiled only.)
    n, d = 2**26, 16
    A = jax.ShapeDtypeStruct((n,), jnp.float32)
    x0 = jax.ShapeDtypeStruct((n,), jnp.float32)
    coeffs = jax.ShapeDtypeStruct((d,), jnp.float32)

    def op(a):
        return lambda x: a * x + jnp.roll(x, 1)

    def readout(a, x0, coeffs):
        return jnp.sum(krylovjax.polynomial_action(op(a), x0, coeffs) ** 2)

    vector = n * 4
    got = temp_bytes(jax.value_and_grad(readout, (0, 1, 2)), A, x0, coeffs)
    assert got < 9 * vector, got / vector


# ------------------------------------------------------------------- errors


A3 = jnp.eye(3) / 2
X3 = jnp.ones(3)


@pytest.mark.parametrize(
    ("C", "match"),
    [
        (jnp.ones((2, 4)), "krylov_readout(C=...)` must be a matrix of shape (p, 3)"),
        (jnp.ones(3), "krylov_readout(C=...)` must be a matrix of shape (p, 3)"),
        (jnp.ones((2, 3), jnp.int32), "krylov_readout(C=...)"),
        ("C", "krylov_readout(C=...)` must be a (p, 3) matrix"),
        (lambda x: jnp.sum(x), "krylov_readout(C=...)"),
        (lambda x: x**2, "krylov_readout(C=...)"),
        (lambda x: (10 * x).astype(jnp.int32), "with floating-point or complex"),
    ],
)
def test_readout_matrix_errors(C, match):
    with pytest.raises((TypeError, ValueError)) as info:
        unchecked(krylovjax.krylov_readout)(A3, X3, 3, C)
    assert match in str(info.value)


@pytest.mark.parametrize(
    ("coeffs", "x0", "match"),
    [
        (jnp.ones((3, 2)), X3, "polynomial_action(coeffs=...)` must have shape (d,)"),
        (jnp.ones((0,)), X3, "polynomial_action(coeffs=...)` must have shape (d,)"),
        (jnp.ones((3, 2, 2)), X3, "needs `x0` of shape (n, 2)"),
        (jnp.ones(3, jnp.int32), X3, "polynomial_action(coeffs=...)"),
    ],
)
def test_coefficient_errors(coeffs, x0, match):
    with pytest.raises((TypeError, ValueError)) as info:
        unchecked(krylovjax.polynomial_action)(A3, x0, coeffs)
    assert match in str(info.value)


@pytest.mark.parametrize("checkpoints", [-1, 2.0, True])
def test_checkpoints_errors(checkpoints):
    with pytest.raises((TypeError, ValueError)) as info:
        unchecked(krylovjax.krylov_readout)(A3, X3, 3, A3, checkpoints=checkpoints)
    assert "krylov_readout(checkpoints=...)" in str(info.value)


def test_layout_error():
    with pytest.raises(ValueError, match="layout"):
        unchecked(krylovjax.krylov_readout)(A3, X3, 3, A3, layout="cols")
