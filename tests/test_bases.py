"""Tests of the polynomial bases (`Chebyshev`, `Legendre`, `Jacobi`, `ThreeTerm`)
and of `spectrum_interval`.

The coefficients are checked by running the recurrence in NumPy at points of a
non-default interval and comparing with `scipy.special`; gradients against finite
differences and, for Chebyshev's interval, a closed form. Each group of checks
shares one jitted program.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special as sp
from helpers import unchecked
from jax.experimental import sparse
from jax.test_util import check_grads

import krylovjax

D = 12
LO, HI = -0.5, 3.0
# 2d points, a little beyond the interval at both ends.
POINTS = np.linspace(LO - 0.1, HI + 0.1, 2 * D)
T_OF_POINTS = (2 * POINTS - (HI + LO)) / (HI - LO)
JACOBI = [(0.0, 0.0), (-0.5, -0.5), (-0.3, -0.7), (0.6, -0.6), (1.5, 0.25)]


def evaluate(a, b, c, lam):
    """`(d, len(lam))`: p_0 .. p_{d-1} at `lam` by the recurrence, in NumPy."""
    prev, p = np.zeros_like(lam), np.ones_like(lam)
    rows = [p]
    for k in range(len(a)):
        prev, p = p, (a[k] * lam + b[k]) * p - c[k] * prev
        rows.append(p)
    return np.stack(rows)


def reference(name, t):
    k = np.arange(D)[:, None]
    if name == "chebyshev_t":
        return sp.eval_chebyt(k, t)
    if name == "chebyshev_u":
        return sp.eval_chebyu(k, t)
    if name == "legendre":
        return sp.eval_legendre(k, t)
    alpha, beta = JACOBI[int(name.split("_")[1])]
    return sp.eval_jacobi(k, alpha, beta, t)


def _bases(lo, hi):
    bases = {
        "chebyshev_t": krylovjax.Chebyshev(lo, hi),
        "chebyshev_u": krylovjax.Chebyshev(lo, hi, kind=2),
        "legendre": krylovjax.Legendre(lo, hi),
    }
    for i, (alpha, beta) in enumerate(JACOBI):
        bases[f"jacobi_{i}"] = krylovjax.Jacobi(alpha, beta, lo, hi)
    return bases


@jax.jit
def _all_coefficients(lo, hi, a, c):
    bases = _bases(lo, hi)
    out = {name: basis.coefficients(D, jnp.float64) for name, basis in bases.items()}
    out["three_term"] = krylovjax.ThreeTerm(a, 0.5, c).coefficients(D, jnp.float64)
    out["float32"] = bases["jacobi_2"].coefficients(D, jnp.float32)
    out["d=1"] = [basis.coefficients(1, jnp.float64) for basis in bases.values()]
    return out


A_LONG = np.linspace(1.0, 2.0, D + 3)
C_LONG = np.linspace(-1.0, 1.0, D - 1)


@pytest.fixture(scope="module")
def coefficients():
    out = _all_coefficients(LO, HI, A_LONG, C_LONG)
    return jax.tree.map(np.asarray, out)


@pytest.mark.parametrize("name", list(_bases(LO, HI)))
def test_polynomials_match_scipy(coefficients, name):
    a, b, c = coefficients[name]
    assert a.shape == b.shape == c.shape == (D - 1,) and c[0] == 0
    values = evaluate(a, b, c, POINTS)
    expected = reference(name, T_OF_POINTS)
    # Relative to the largest |p_k| over the points, for each degree k.
    scale = np.max(np.abs(expected), axis=1, keepdims=True)
    error = np.max(np.abs(values - expected) / scale)
    assert error <= 1e-12, error


def test_jacobi_special_cases(coefficients):
    # (0, 0) is Legendre; (-1/2, -1/2) is binom(2k, k) / 4^k T_k.
    for got, want in zip(
        coefficients["jacobi_0"], coefficients["legendre"], strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)
    k = np.arange(D)[:, None]
    scaled_t = sp.comb(2 * k, k) / 4.0**k * sp.eval_chebyt(k, T_OF_POINTS)
    values = evaluate(*coefficients["jacobi_1"], POINTS)
    np.testing.assert_allclose(values, scaled_t, rtol=1e-12, atol=1e-13)


def test_three_term_and_shapes(coefficients):
    a, b, c = coefficients["three_term"]
    np.testing.assert_array_equal(a, A_LONG[: D - 1])
    np.testing.assert_array_equal(b, np.full(D - 1, 0.5))
    np.testing.assert_array_equal(c, np.concatenate([[0.0], C_LONG[1:]]))
    assert all(x.dtype == np.float32 for x in coefficients["float32"])
    assert all(x.shape == (0,) for abc in coefficients["d=1"] for x in abc)


def _polynomial_sums(coefficients, lam):
    """sum_k p_k(lam), in JAX, differentiable."""
    a, b, c = coefficients
    prev, p = jnp.zeros_like(lam), jnp.ones_like(lam)
    total = p
    for k in range(a.shape[0]):
        prev, p = p, (a[k] * lam + b[k]) * p - c[k] * prev
        total = total + p
    return total


GRAD_D = 6
GRAD_POINTS = np.array([-0.3, 0.4, 1.7, 2.9])


@jax.jit
def _sums(lo, hi, alpha, beta, a, b, c):
    bases = [
        krylovjax.Chebyshev(lo, hi, kind=2),
        krylovjax.Legendre(lo, hi),
        # alpha + beta = 0 and alpha + beta = -1.
        krylovjax.Jacobi(alpha[0], beta[0], lo, hi),
        krylovjax.Jacobi(alpha[1], beta[1], lo, hi),
        krylovjax.ThreeTerm(a, b, c),
    ]
    return jnp.concatenate(
        [
            _polynomial_sums(basis.coefficients(GRAD_D, jnp.float64), GRAD_POINTS)
            for basis in bases
        ]
    )


def test_gradients_match_finite_differences():
    args = (
        jnp.asarray(LO),
        jnp.asarray(HI),
        jnp.array([0.3, -0.4]),
        jnp.array([-0.3, -0.6]),
        jnp.asarray(np.linspace(0.5, 1.0, GRAD_D - 1)),
        jnp.asarray(-0.2),
        jnp.asarray(np.linspace(0.2, 0.6, GRAD_D + 1)),
    )
    check_grads(_sums, args, order=1, modes=("rev",))


@jax.jit
def _closed_form_grads(lo, hi, c):
    def chebyshev(lo, hi):
        basis = krylovjax.Chebyshev(lo, hi)
        return _polynomial_sums(basis.coefficients(D, jnp.float64), POINTS).sum()

    def three_term(c):
        basis = krylovjax.ThreeTerm(1.5, -0.5, c)
        return _polynomial_sums(basis.coefficients(D, jnp.float64), POINTS).sum()

    return jax.grad(chebyshev, argnums=(0, 1))(lo, hi), jax.grad(three_term)(c)


def test_chebyshev_interval_gradient_closed_form():
    (g_lo, g_hi), g_c = _closed_form_grads(LO, HI, np.full(D - 1, 0.3))
    # d/dlo T_k(t) = k U_{k-1}(t) dt/dlo, dt/dlo = 2 (lam - hi) / (hi - lo)^2,
    # dt/dhi = 2 (lo - lam) / (hi - lo)^2.
    k = np.arange(1, D)[:, None]
    dT = (k * sp.eval_chebyu(k - 1, T_OF_POINTS)).sum(axis=0)
    width2 = (HI - LO) ** 2
    np.testing.assert_allclose(g_lo, np.sum(dT * 2 * (POINTS - HI) / width2), 1e-12)
    np.testing.assert_allclose(g_hi, np.sum(dT * 2 * (LO - POINTS) / width2), 1e-12)
    # c[0] multiplies p_{-1}: ignored, zero gradient; the others are used.
    assert g_c[0] == 0 and np.all(np.asarray(g_c[1:]) != 0)


# ------------------------------------------------------------ spectrum_interval


def _bcoo(M, padding=0, duplicate=False):
    """`M` as a BCOO matrix built in NumPy: its nonzero entries, then `padding`
    entries with index n (as JAX pads) and value 7 (to show they are ignored),
    and with `duplicate` one off-diagonal entry split into two (summed, as BCOO
    does), the second stored with indices counted from the end (i - n, as JAX's
    products read them)."""
    n = M.shape[0]
    rows, cols = np.nonzero(M)
    data, indices = M[rows, cols], np.stack([rows, cols], axis=1)
    if duplicate:
        i = np.flatnonzero(rows != cols)[0]
        data = np.concatenate([data - 5.0 * (np.arange(len(data)) == i), [5.0]])
        indices = np.concatenate([indices, indices[i : i + 1] - n])
    data = np.concatenate([data, np.full(padding, 7.0)])
    indices = np.concatenate([indices, np.full((padding, 2), n)]).astype(np.int32)
    return sparse.BCOO((data, indices), shape=M.shape)


@jax.jit
def _gershgorin(M, B, H, R):
    exact = [krylovjax.spectrum_interval(X, margin=0.0) for X in (M, B)]
    default = krylovjax.spectrum_interval(M)
    # No derivative: the interval is a hyperparameter.
    grad = jax.grad(lambda M: sum(krylovjax.spectrum_interval(M)))(M)
    # In bfloat16: computed in float32, rounded outwards.
    half = R.astype(jnp.bfloat16)
    rounded = [
        krylovjax.spectrum_interval(X, margin=0.0)
        for X in (half, half.astype(jnp.float32))
    ]
    return B.todense(), exact, default, krylovjax.spectrum_interval(H), grad, rounded


def test_gershgorin_dense_and_bcoo():
    rng = np.random.default_rng(0)
    n = 6
    # Multiples of 1/8, so that splitting an entry into duplicates is exact.
    M = np.round(8 * rng.normal(size=(n, n))) / 8 * (rng.random((n, n)) < 0.5)
    M = M + M.T
    H = M + 1j * np.triu(M, 1) - 1j * np.triu(M, 1).T  # Hermitian
    B = _bcoo(M, padding=3, duplicate=True)
    # Its bounds, in float32, round inwards to nearest in bfloat16.
    R = np.random.default_rng(2).normal(size=(n, n))
    B_dense, (dense, bcoo), default, hermitian, grad, rounded = _gershgorin(
        M, B, H, R + R.T
    )
    np.testing.assert_array_equal(B_dense, M)
    np.testing.assert_array_equal(grad, np.zeros_like(M))
    (half_lo, half_hi), (lo32, hi32) = rounded
    assert half_lo.dtype == half_hi.dtype == jnp.bfloat16
    assert half_lo.astype(np.float32) <= lo32 and hi32 <= half_hi.astype(np.float32)
    radius = np.abs(M).sum(axis=1) - np.abs(np.diag(M))
    lo, hi = np.min(np.diag(M) - radius), np.max(np.diag(M) + radius)
    np.testing.assert_allclose(dense, (lo, hi), rtol=1e-15)
    np.testing.assert_allclose(bcoo, (lo, hi), rtol=1e-15)
    widened = (lo - 0.01 * (hi - lo), hi + 0.01 * (hi - lo))
    np.testing.assert_allclose(default, widened, rtol=1e-15)
    for (lo, hi), X in ((default, M), (hermitian, H)):
        assert lo.shape == hi.shape == () and lo.dtype == hi.dtype == np.float64
        eigenvalues = np.linalg.eigvalsh(X)
        assert lo < eigenvalues[0] and eigenvalues[-1] < hi


@jax.jit
def _lanczos_intervals(L, B, K, key):
    # No margin: the extreme Ritz values widened by their residual bounds.
    options = {"method": "lanczos", "key": key, "d": 20, "margin": 0.0}
    dense = krylovjax.spectrum_interval(L, **options)
    bcoo = krylovjax.spectrum_interval(B, **options)
    n = L.shape[0]
    fn = krylovjax.spectrum_interval(lambda v: L @ v, n=n, dtype=jnp.float64, **options)
    # Two distinct eigenvalues: an invariant space after two steps.
    breakdown = krylovjax.spectrum_interval(K, method="lanczos", key=key, d=5)
    return dense, bcoo, fn, breakdown


def test_lanczos_on_a_path_graph():
    n = 50
    L = np.diag(np.r_[1.0, np.full(n - 2, 2.0), 1.0])
    L = L - np.eye(n, k=1) - np.eye(n, k=-1)
    K = 8 * np.eye(6) - np.ones((6, 6))  # eigenvalues 2 and 8
    out = _lanczos_intervals(L, _bcoo(L), K, jax.random.key(0))
    (lo, hi), bcoo, fn, breakdown = out
    np.testing.assert_allclose(bcoo, (lo, hi), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(fn, (lo, hi), rtol=1e-12, atol=1e-14)
    eigenvalues = np.linalg.eigvalsh(L)
    spread = eigenvalues[-1] - eigenvalues[0]
    assert lo <= eigenvalues[0] and eigenvalues[-1] <= hi
    assert eigenvalues[0] - lo <= 0.05 * spread
    assert hi - eigenvalues[-1] <= 0.05 * spread
    # With the default margin, 1% of the width 6 at each end.
    np.testing.assert_allclose(breakdown, (2 - 0.06, 8 + 0.06), rtol=1e-12)


# ------------------------------------------------------------------- errors

M2 = np.array([[2.0, 1.0], [1.0, 3.0]])
KEY = jax.random.key(0)
LANCZOS = {"method": "lanczos", "key": KEY}


def _stale_interval():
    # A concrete bad value set after construction is caught by `coefficients`.
    basis = eqx.tree_at(lambda b: b.lo, krylovjax.Legendre(), jnp.asarray(5.0))
    return basis.coefficients(3, jnp.float64)


def _case(id, call, error, match):
    return pytest.param(call, error, match, id=id)


ERRORS = [
    _case(
        "kind",
        lambda: krylovjax.Chebyshev(kind=3),
        ValueError,
        r"`Chebyshev\(kind=...\)` must be 1 \(first kind, T_k\) or 2 .*; got 3\.",
    ),
    _case(
        "kind-bool",
        lambda: krylovjax.Chebyshev(kind=True),
        ValueError,
        r"`Chebyshev\(kind=...\)` must be 1 .*; got True\.",
    ),
    _case(
        "lo>=hi",
        lambda: krylovjax.Chebyshev(2.0, 1.0),
        ValueError,
        r"`Chebyshev\(lo=..., hi=...\)` must have lo < hi; got lo=2.0, hi=1.0\.",
    ),
    _case(
        "lo>=hi-later",
        _stale_interval,
        ValueError,
        r"`Legendre\(lo=..., hi=...\)` must have lo < hi; got lo=5.0, hi=1.0\.",
    ),
    _case(
        "hi-inf",
        lambda: krylovjax.Legendre(hi=np.inf),
        ValueError,
        r"`Legendre\(hi=...\)` must be finite; got inf\.",
    ),
    _case(
        "lo-complex",
        lambda: unchecked(krylovjax.Chebyshev)(1j),
        TypeError,
        r"`Chebyshev\(lo=...\)` must be real; got dtype complex128\.",
    ),
    _case(
        "lo-vector",
        lambda: unchecked(krylovjax.Legendre)(np.zeros(2)),
        ValueError,
        r"`Legendre\(lo=...\)` must have shape \(\) \(a scalar\); got shape \(2,\)\.",
    ),
    _case(
        "alpha",
        lambda: krylovjax.Jacobi(-1.0, 0.0),
        ValueError,
        r"`Jacobi\(alpha=...\)` must be > -1; got -1.0\.",
    ),
    _case(
        "beta",
        lambda: krylovjax.Jacobi(0.0, -1.5),
        ValueError,
        r"`Jacobi\(beta=...\)` must be > -1; got -1.5\.",
    ),
    _case(
        "three-term-rank",
        lambda: unchecked(krylovjax.ThreeTerm)(np.ones((2, 2)), 0.0, 0.0),
        ValueError,
        r"`ThreeTerm\(a=...\)` must be a scalar or a vector; got shape \(2, 2\)\.",
    ),
    _case(
        "three-term-nan",
        lambda: krylovjax.ThreeTerm(1.0, np.array([0.0, np.nan]), 0.0),
        ValueError,
        r"`ThreeTerm\(b=...\)` must be finite; got \[ 0. nan\]\.",
    ),
    _case(
        "three-term-short",
        lambda: krylovjax.ThreeTerm(np.ones(5), 0.0, 0.0).coefficients(10, np.float64),
        ValueError,
        r"`ThreeTerm\(a=...\)` must have at least d - 1 = 9 entries for d = 10; "
        r"got shape \(5,\)\.",
    ),
    _case(
        "d",
        lambda: krylovjax.Legendre().coefficients(0, np.float64),
        ValueError,
        r"`Legendre.coefficients\(d=...\)` must be an int >= 1 \(the number of "
        r"polynomials\); got 0\.",
    ),
    _case(
        "d-float",
        lambda: unchecked(krylovjax.Legendre().coefficients)(2.0, np.float64),
        TypeError,
        r"`Legendre.coefficients\(d=...\)` must be a Python int >= 1",
    ),
    _case(
        "dtype",
        lambda: krylovjax.Legendre().coefficients(3, np.complex64),
        TypeError,
        r"`Legendre.coefficients\(dtype=...\)` must be a real floating-point dtype "
        r"or None; got dtype complex64\.",
    ),
    # Valid in float64 (the fields' dtype under x64), not in the vectors' float32.
    _case(
        "jacobi-rounds-to-minus-one",
        lambda: krylovjax.krylov(
            np.eye(2, dtype=np.float32),
            np.ones(2, np.float32),
            3,
            basis=krylovjax.Jacobi(-1 + 1e-9, 0.5),
        ),
        ValueError,
        r"`Jacobi\(alpha=...\)` must be > -1 in float32, the precision of the "
        r"computation; got -1.0 \(rounded from -0.999999999\)\.",
    ),
    _case(
        "interval-rounds-to-a-point",
        lambda: krylovjax.Chebyshev(1.0, 1 + 1e-9).coefficients(3, np.float32),
        ValueError,
        r"`Chebyshev\(lo=..., hi=...\)` must have lo < hi in float32, the precision "
        r"of the computation; got lo=1.0, hi=1.0 \(rounded from 1.000000001\)\.",
    ),
    _case(
        "three-term-overflows",
        lambda: krylovjax.ThreeTerm(1e39, 0.0, 0.0).coefficients(3, np.float32),
        ValueError,
        r"`ThreeTerm\(a=...\)` must be finite in float32, the precision of the "
        r"computation; got inf \(rounded from 1e\+39\)\.",
    ),
    _case(
        "gershgorin-callable",
        lambda: krylovjax.spectrum_interval(lambda v: v),
        ValueError,
        r"`spectrum_interval\(A=...\)` must be a dense or BCOO matrix for "
        r'method="gershgorin", which needs its entries; got a callable .* Use '
        r'method="lanczos"',
    ),
    _case(
        "not-square",
        lambda: unchecked(krylovjax.spectrum_interval)(np.ones((2, 3))),
        ValueError,
        r"`spectrum_interval\(A=...\)` must be a square \(n, n\) matrix with "
        r"n >= 1; got shape \(2, 3\)\.",
    ),
    _case(
        "key",
        lambda: krylovjax.spectrum_interval(M2, method="lanczos"),
        ValueError,
        r"`spectrum_interval\(key=...\)` must be a `jax.random` key for "
        r'method="lanczos" \(it draws the start vector\); got None\.',
    ),
    _case(
        "key-int",
        lambda: unchecked(krylovjax.spectrum_interval)(M2, method="lanczos", key=0),
        TypeError,
        r"`spectrum_interval\(key=...\)` must be one JAX PRNG key, e.g. "
        r"`jax.random.key\(0\)`; got int\.",
    ),
    _case(
        "callable-n",
        lambda: krylovjax.spectrum_interval(lambda v: v, dtype=np.float32, **LANCZOS),
        ValueError,
        r"`spectrum_interval\(n=...\)` is required for a callable `A`",
    ),
    _case(
        "callable-dtype",
        lambda: krylovjax.spectrum_interval(lambda v: v, n=2, **LANCZOS),
        ValueError,
        r"`spectrum_interval\(dtype=...\)` is required for a callable `A`",
    ),
    _case(
        "matrix-n",
        lambda: krylovjax.spectrum_interval(M2, n=2, **LANCZOS),
        ValueError,
        r"`spectrum_interval\(n=...\)` is for a callable `A`; a matrix has its "
        r"own, so it must be None; got 2\.",
    ),
    _case(
        "gershgorin-n",
        lambda: krylovjax.spectrum_interval(M2, n=3),
        ValueError,
        r"`spectrum_interval\(n=...\)` is for `method=\"lanczos\"` with a callable "
        r"`A`; Gershgorin discs read a matrix, so it must be None; got 3\.",
    ),
    _case(
        "margin",
        lambda: krylovjax.spectrum_interval(M2, margin=-0.1),
        ValueError,
        r"`spectrum_interval\(margin=...\)` must be finite and >= 0; got -0.1\.",
    ),
    _case(
        "method",
        lambda: unchecked(krylovjax.spectrum_interval)(M2, method="qr"),
        ValueError,
        r"`spectrum_interval\(method=...\)` must be one of 'gershgorin', "
        r"'lanczos'; got 'qr'\.",
    ),
]


@pytest.mark.parametrize("call, error, match", ERRORS)
def test_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()
