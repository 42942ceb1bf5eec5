"""`krylov(basis=...)`: the polynomial bases on the three-term recurrence engine.

Values against `scipy.special` evaluated on the eigendecomposition of `A`;
derivatives against plain autodiff through the same recurrence
(`adjoint="autodiff"`), float64 finite differences and a closed form (the
derivative of a Chebyshev polynomial in the interval's end); compiled memory
against autodiff (which also proves that the hand-written rule runs); operator
kinds, transforms and errors. (The coefficients themselves: test_bases.py.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from helpers import Linear, check_finite_differences, temp_bytes, unchecked
from jax.experimental import sparse

import krylovjax
from krylovjax import Chebyshev, Jacobi, Legendre, ThreeTerm

N, D = 8, 7


def symmetric(n=N, seed=0, dtype=np.float64):
    """A symmetric (Hermitian) matrix with spectrum in (-1, 1)."""
    rng = np.random.default_rng(seed)
    M = rng.standard_normal((n, n))
    if np.issubdtype(dtype, np.complexfloating):
        M = M + 1j * rng.standard_normal((n, n))
    S = (M + M.conj().T) / 2
    return (S / (1.05 * np.abs(np.linalg.eigvalsh(S)).max())).astype(dtype)


def vectors(shape, seed=1, dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    if np.issubdtype(dtype, np.complexfloating):
        x = x + 1j * rng.standard_normal(shape)
    return x.astype(dtype)


def reference(S, x0, evaluate, d=D):
    """`[p_0(S) x0, ..., p_(d-1)(S) x0]` (columns layout) by eigh, in NumPy."""
    w, V = np.linalg.eigh(S)
    cols = [(V * evaluate(k, w)) @ V.conj().T @ x0 for k in range(d)]
    return np.stack(cols, axis=1)


def t_of(w, lo, hi):
    return (2 * w - (hi + lo)) / (hi - lo)


def test_values_match_scipy_on_the_eigendecomposition():
    """Chebyshev (both kinds), Legendre and Jacobi on an interval wider than the
    spectrum, a vector and a block `x0`, both layouts, a complex Hermitian matrix:
    one program, against `scipy.special` on the eigenvalues."""
    lo, hi = -1.2, 1.5
    S, S_c = symmetric(), symmetric(dtype=np.complex128)
    x, X = vectors(N), vectors((N, 3))
    x_c = vectors(N, dtype=np.complex128)
    bases = {
        "chebyt": (Chebyshev(lo, hi), lambda k, t: scipy.special.eval_chebyt(k, t)),
        "chebyu": (
            Chebyshev(lo, hi, kind=2),
            lambda k, t: scipy.special.eval_chebyu(k, t),
        ),
        "legendre": (Legendre(lo, hi), lambda k, t: scipy.special.eval_legendre(k, t)),
        "jacobi": (
            Jacobi(0.5, -0.3, lo, hi),
            lambda k, t: scipy.special.eval_jacobi(k, 0.5, -0.3, t),
        ),
    }

    @jax.jit
    def run(S, x, X, S_c, x_c):
        out = {
            name: krylovjax.krylov(S, x, D, basis=b) for name, (b, _) in bases.items()
        }
        out["block"] = krylovjax.krylov(S, X, D, basis=bases["legendre"][0])
        out["rows"] = krylovjax.krylov(S, x, D, basis=bases["chebyt"][0], layout="rows")
        out["complex"] = krylovjax.krylov(S_c, x_c, D, basis=bases["jacobi"][0])
        return out

    out = run(*map(jnp.asarray, (S, x, X, S_c, x_c)))
    for name, (_, f) in bases.items():
        want = reference(S, x, lambda k, w, f=f: f(k, t_of(w, lo, hi)))
        np.testing.assert_allclose(
            out[name], want, rtol=1e-12, atol=1e-12, err_msg=name
        )
    legendre = bases["legendre"][1]
    want = reference(S, X, lambda k, w: legendre(k, t_of(w, lo, hi)))
    assert out["block"].shape == (N, D, 3)
    np.testing.assert_allclose(out["block"], want, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(out["rows"], out["chebyt"].T)
    jacobi = bases["jacobi"][1]
    want = reference(S_c, x_c, lambda k, w: jacobi(k, t_of(w, lo, hi)))
    assert out["complex"].dtype == jnp.complex128
    np.testing.assert_allclose(out["complex"], want, rtol=1e-12, atol=1e-12)


def test_chebyshev_is_bounded_where_the_monomial_basis_grows():
    """A normalised graph Laplacian (spectrum in [0, 2]) at d = 200 in float32:
    every Chebyshev vector on [0, 2] has norm at most that of x0, where the powers
    of the Laplacian grow like 2^k and overflow."""
    n = 16
    adjacency = np.roll(np.eye(n), 1, axis=0) + np.roll(np.eye(n), -1, axis=0)
    L = np.eye(n) - adjacency / 2  # the cycle's normalised Laplacian: spectrum [0, 2]
    x0 = vectors(n) / np.linalg.norm(vectors(n))
    run = jax.jit(
        lambda L, x0: (
            krylovjax.krylov(L, x0, 200, basis=Chebyshev(0.0, 2.0)),
            krylovjax.krylov(L, x0, 200),
        )
    )
    cheb, mono = run(jnp.asarray(L, jnp.float32), jnp.asarray(x0, jnp.float32))
    norms = np.linalg.norm(np.asarray(cheb), axis=0)
    assert norms.max() <= 1 + 1e-5, norms.max()
    assert not np.isfinite(np.asarray(mono)).all()


def test_chebyshev_gram_matrix_is_well_conditioned_at_d_64():
    """The d x d Gram matrix of the basis polynomials sampled at 2d Chebyshev points
    of the interval [0, 2], at d = 64, in float64: condition number at most 10 for
    Chebyshev polynomials (2, by discrete orthogonality), above 1e15 for the
    monomials. The samples are `krylov` of the diagonal matrix of the points."""
    d = 64
    points = 1 + np.cos(np.pi * (np.arange(2 * d) + 0.5) / (2 * d))
    run = jax.jit(
        lambda A, x: (
            krylovjax.krylov(A, x, d, basis=Chebyshev(0.0, 2.0)),
            krylovjax.krylov(A, x, d),
        )
    )
    cheb, mono = run(jnp.diag(jnp.asarray(points)), jnp.ones(2 * d))
    cheb, mono = np.asarray(cheb), np.asarray(mono)
    assert np.linalg.cond(cheb.T @ cheb) <= 10
    assert np.linalg.cond(mono.T @ mono) > 1e15


def _problem(seed=0):
    S, x = symmetric(seed=seed), vectors(N, seed=seed + 1)
    rng = np.random.default_rng(seed + 2)
    a, b, c = (rng.uniform(0.5, 1.5, D - 1) for _ in range(3))
    W = rng.standard_normal((N, D))
    return S, x, (a, b, c), W


def test_derivatives_match_autodiff_finite_differences_and_a_closed_form():
    """A learnable `ThreeTerm` basis: the gradients of `A`, `x0` and the three
    coefficient arrays, a JVP along all of them and the Hessian in `x0` and `a`, by
    the default rule against plain autodiff through the same recurrence (close,
    and not bitwise equal: the hand-written rule ran); the first derivatives against
    finite differences in float64 (forward and reverse mode), from the same
    program; and the derivative of a Chebyshev basis in the interval's end against
    $\\partial_{hi} T_k(t) = k U_{k-1}(t)\\, \\partial_{hi} t$ on the
    eigendecomposition."""
    S, x, coefficients, W = _problem()
    lo, hi = -1.1, 1.3

    def loss(adjoint):
        def f(S, x, a, b, c):
            X = krylovjax.krylov(S, x, D, basis=ThreeTerm(a, b, c), adjoint=adjoint)
            return jnp.sum(jnp.sin(X) * W)

        return f

    def chebyshev(S, x, hi):
        return jnp.sum(krylovjax.krylov(S, x, D, basis=Chebyshev(lo, hi)) * W)

    @jax.jit
    def derivatives(args, tangents, cotangent):
        out = {}
        for adjoint in ("custom_jvp", "autodiff"):
            f = loss(adjoint)
            value, vjp = jax.vjp(f, *args)
            out[adjoint] = (
                value,
                vjp(cotangent),
                jax.jvp(f, args, tangents)[1],
                jax.hessian(f, argnums=(1, 2))(*args),
            )
        out["hi"] = jax.grad(chebyshev, argnums=2)(args[0], args[1], hi_value)
        return out

    args = tuple(jnp.asarray(v, jnp.float64) for v in (S, x, *coefficients))
    hi_value = jnp.asarray(hi, jnp.float64)
    tangents = tuple(jnp.asarray(vectors(np.shape(v), seed=9)) for v in args)
    out = derivatives(args, tangents, jnp.ones((), jnp.float64))
    rule, auto = out["custom_jvp"], out["autodiff"]
    for got, want in zip(jax.tree.leaves(rule), jax.tree.leaves(auto), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)
    assert any(
        not np.array_equal(got, want)
        for got, want in zip(rule[1], auto[1], strict=True)
    )

    def first_derivatives(args, tangents, cotangent):
        value, vjp, jvp, _ = derivatives(args, tangents, cotangent)["custom_jvp"]
        return value, vjp, jvp

    check_finite_differences(loss("custom_jvp"), first_derivatives, args)

    w, V = np.linalg.eigh(S)
    t = t_of(w, lo, hi)
    dt_dhi = -2 * (w - lo) / (hi - lo) ** 2
    want = sum(
        W[:, k] @ ((V * (k * scipy.special.eval_chebyu(k - 1, t) * dt_dhi)) @ V.T @ x)
        for k in range(1, D)
    )
    np.testing.assert_allclose(out["hi"], want, rtol=1e-11)


def test_operator_kinds_and_transforms_agree_with_the_dense_matrix():
    """A BCOO matrix, a closure and an Equinox module give the dense matrix's values
    and gradients (of the matrix's arrays, x0 and the basis's interval); `vmap`
    over a batch of starting vectors and over a batch of matrices matches the
    loop over them. One program."""
    S, x, _, W = _problem(seed=3)
    basis_of = lambda lo: Legendre(lo, 1.2)  # noqa: E731
    Sb = sparse.BCOO.fromdense(jnp.asarray(S))

    def loss(A, x, lo):
        return jnp.sum(jnp.cos(krylovjax.krylov(A, x, D, basis=basis_of(lo))) * W)

    @jax.jit
    def run(S, data, x, lo, xs, Ss):
        bcoo = sparse.BCOO((data, Sb.indices), shape=Sb.shape)
        kinds = {
            "dense": jax.grad(loss, argnums=(0, 1, 2))(S, x, lo),
            "bcoo": jax.grad(
                lambda data, x, lo: loss(
                    sparse.BCOO((data, Sb.indices), shape=Sb.shape), x, lo
                ),
                argnums=(0, 1, 2),
            )(data, x, lo),
            "closure": jax.grad(
                lambda S, x, lo: loss(lambda v: S @ v, x, lo), argnums=(0, 1, 2)
            )(S, x, lo),
            "module": jax.grad(
                lambda S, x, lo: loss(Linear(S), x, lo), argnums=(0, 1, 2)
            )(S, x, lo),
        }
        values = [krylovjax.krylov(A, x, D, basis=basis_of(lo)) for A in (S, bcoo)]
        batched = {
            "x0": jax.vmap(lambda v: krylovjax.krylov(S, v, D, basis=basis_of(lo)))(xs),
            "A": jax.vmap(lambda M: krylovjax.krylov(M, x, D, basis=basis_of(lo)))(Ss),
            "x0 loop": jnp.stack(
                [krylovjax.krylov(S, v, D, basis=basis_of(lo)) for v in xs]
            ),
            "A loop": jnp.stack(
                [krylovjax.krylov(M, x, D, basis=basis_of(lo)) for M in Ss]
            ),
        }
        return kinds, values, batched

    xs = vectors((3, N), seed=5)
    Ss = np.stack([symmetric(seed=s) for s in (6, 7)])
    kinds, values, batched = run(*map(jnp.asarray, (S, Sb.data, x, -1.1, xs, Ss)))
    np.testing.assert_allclose(values[1], values[0], rtol=1e-13, atol=1e-13)
    dense = kinds["dense"]
    rows, cols = np.asarray(Sb.indices).T
    for kind in ("bcoo", "closure", "module"):
        want = dense[0][rows, cols] if kind == "bcoo" else dense[0]
        np.testing.assert_allclose(
            kinds[kind][0], want, rtol=1e-12, atol=1e-13, err_msg=kind
        )
        for got, want in zip(kinds[kind][1:], dense[1:], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13, err_msg=kind)
    for batch in ("x0", "A"):
        np.testing.assert_allclose(
            batched[batch], batched[f"{batch} loop"], rtol=1e-13, atol=1e-13
        )


LOSSES = {
    "sum": lambda X, W, C: X.sum(),
    "weights": lambda X, W, C: jnp.sum(X * W),
    "readout": lambda X, W, C: jnp.sum(jnp.tanh(C @ X)),
    "last column": lambda X, W, C: jnp.sum(X[:, -1] ** 2),
}


@pytest.mark.parametrize("loss", LOSSES)
def test_reverse_pass_memory_is_below_plain_autodiff(loss):
    """Compiled temporary memory of the gradient (of `A`, `x0`, the coefficients)
    by the default rule: below plain autodiff through the same recurrence, for
    every loss form, at (n, d) = (256, 200) in float32 (below by at least the
    d - 2 vectors that autodiff keeps for the recurrence's second carry; the
    rule's buffers are within 64 vectors of that)."""
    n, d = 256, 200
    rng = np.random.default_rng(0)
    S = jnp.asarray(rng.standard_normal((n, n)) / np.sqrt(n) / 2, jnp.float32)
    x = jnp.asarray(rng.standard_normal(n), jnp.float32)
    W = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    C = jnp.asarray(rng.standard_normal((4, n)), jnp.float32)
    coefficients = tuple(jnp.full(d - 1, v, jnp.float32) for v in (1.0, 0.1, 0.2))

    def grad(adjoint):
        def f(S, x, coefficients):
            X = krylovjax.krylov(
                S, x, d, basis=ThreeTerm(*coefficients), adjoint=adjoint
            )
            return LOSSES[loss](X, W, C)

        return jax.grad(f, argnums=(0, 1, 2))

    rule, auto = (
        temp_bytes(grad(adjoint), S, x, coefficients)
        for adjoint in ("custom_jvp", "autodiff")
    )
    vector = n * 4
    assert rule <= auto - (d - 2 - 64) * vector, (rule / vector, auto / vector)


def test_errors_name_the_argument():
    S, x = jnp.eye(3), jnp.ones(3)
    with pytest.raises(TypeError, match=r"`krylov\(basis=\.\.\.\)` must be"):
        unchecked(krylovjax.krylov)(S, x, 4, basis="chebyshev")
    with pytest.raises(ValueError, match=r"method='doubling'"):
        krylovjax.krylov(S, x, 4, basis=Chebyshev(), method="doubling")
    with pytest.raises(ValueError, match=r"adjoint='custom_vjp'"):
        krylovjax.krylov(S, x, 4, basis=Chebyshev(), adjoint="custom_vjp")
