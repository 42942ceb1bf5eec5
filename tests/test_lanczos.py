"""`krylovjax.lanczos`: values, derivatives (three oracles), transforms, breakdown,
errors and the memory of the reverse pass."""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    DTYPES,
    decomposition_problem,
    lanczos_numpy,
    random_array,
    random_like,
    unchecked,
)
from jax.test_util import check_grads

import krylovjax

N, D = 6, 4
ADJOINTS = ("custom_jvp", "autodiff")


def _tol(dtype):
    if jnp.finfo(dtype).bits <= 32:
        return {"rtol": 2e-4, "atol": 2e-5}
    return {"rtol": 1e-10, "atol": 1e-12}


def _lanczos(build, d=D, **kwargs):
    """`(params, x0) -> lanczos(build(params), x0, d, **kwargs)`, as a tuple."""

    def f(params, x0):
        dec = krylovjax.lanczos(build(params), x0, d, **kwargs)
        return dec.basis, dec.diagonal, dec.off_diagonal, dec.residual, dec.norm

    return f


def _hermitian(dtype, n=N, seed=0):
    params, _, _, x0 = decomposition_problem(
        "dense", dtype, n=n, hermitian=True, seed=seed
    )
    return params, x0


def _check_decomposition(dec, A, x0, d, reorth):
    """Shapes, dtypes, the Lanczos relation, orthonormality, T real symmetric
    tridiagonal, and agreement with the NumPy reference."""
    dtype = x0.dtype
    real = jnp.finfo(dtype).dtype
    assert dec.basis.shape == (N, d) and dec.basis.dtype == dtype
    assert dec.diagonal.shape == (d,) and dec.diagonal.dtype == real
    assert dec.off_diagonal.shape == (d - 1,) and dec.off_diagonal.dtype == real
    assert dec.residual.shape == (N,) and dec.residual.dtype == dtype
    assert dec.norm.shape == () and dec.norm.dtype == real
    T = np.asarray(dec.matrix())
    assert T.shape == (d, d) and T.dtype == real
    np.testing.assert_array_equal(T, T.T)
    assert np.all(np.triu(T, 2) == 0) and np.all(np.asarray(dec.off_diagonal) >= 0)
    Q, r = (np.asarray(x, np.complex128) for x in (dec.basis, dec.residual))
    A = np.asarray(A, np.complex128)
    tol = _tol(dtype)
    atol = 10 * tol["atol"]
    np.testing.assert_allclose(Q.conj().T @ Q, np.eye(d), atol=atol)
    np.testing.assert_allclose(Q.conj().T @ A @ Q, T, atol=atol)
    e_last = np.eye(d)[-1]
    np.testing.assert_allclose(A @ Q, Q @ T + np.outer(r, e_last), atol=atol)
    reference = lanczos_numpy(A, x0, d, reorth)
    got = (Q, dec.diagonal, dec.off_diagonal, r, dec.norm)
    for a, b in zip(got, reference, strict=True):
        np.testing.assert_allclose(np.asarray(a), b, **tol)


def _decompose(A, x0, d, **kwargs):
    f = jax.jit(krylovjax.lanczos, static_argnums=2, static_argnames=tuple(kwargs))
    return f(A, x0, d, **kwargs)


# ---------------------------------------------------------------------- values


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reorth", [True, False])
def test_values_dense(dtype, reorth):
    A, x0 = _hermitian(dtype)
    dec = _decompose(A, x0, D, reorthogonalize=reorth)
    _check_decomposition(dec, A, x0, D, reorth)


@pytest.mark.parametrize(
    "kind,dtype",
    [("bcoo", jnp.complex128), ("closure", jnp.float32), ("module", jnp.complex64)],
)
def test_values_operator_kinds(kind, dtype):
    params, build, dense, x0 = decomposition_problem(kind, dtype, n=N, hermitian=True)
    dec = jax.jit(lambda p, x: krylovjax.lanczos(build(p), x, D))(params, x0)
    _check_decomposition(dec, dense(params), x0, D, True)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.complex128])
def test_full_dimension_reproduces_the_spectrum(dtype):
    A, x0 = _hermitian(dtype)
    dec = _decompose(A, x0, N)
    np.testing.assert_allclose(dec.residual, 0, atol=1e-12)
    got = np.linalg.eigvalsh(np.asarray(dec.matrix()))
    np.testing.assert_allclose(got, np.linalg.eigvalsh(np.asarray(A)), atol=1e-12)


def test_reorthogonalization_keeps_the_basis_orthonormal():
    # Widely spread eigenvalues: the first Ritz values converge within a few
    # steps, and the plain recurrence then loses orthogonality (Paige).
    n = 40
    A = jnp.diag(jnp.asarray(np.geomspace(1.0, 1e4, n)))
    x0 = jnp.ones(n)
    loss = {}
    for reorth in (True, False):
        Q = np.asarray(_decompose(A, x0, n, reorthogonalize=reorth).basis)
        loss[reorth] = np.abs(Q.T @ Q - np.eye(n)).max()
    assert loss[True] < 1e-12 < 1e-3 < loss[False]


def test_matrix_after_vmap():
    A, _ = _hermitian(jnp.float64)
    xs = random_array(jr.key(1), (3, N), jnp.float64)

    @jax.jit
    def run(A, xs):
        decs = jax.vmap(lambda x: krylovjax.lanczos(A, x, D))(xs)
        return decs.matrix(), krylovjax.lanczos(A, xs[1], D).matrix()

    T, T1 = run(A, xs)
    assert T.shape == (3, D, D)
    np.testing.assert_allclose(T[1], T1, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------- derivatives

# Every kind, both dtypes and both settings, in few compilations (the module is a
# dense matrix inside).
GRADIENT_CASES = [
    ("dense", jnp.complex128, False),
    ("bcoo", jnp.float64, False),
    ("closure", jnp.complex128, True),
    ("module", jnp.float64, True),
]


@pytest.mark.parametrize("kind,dtype,reorth", GRADIENT_CASES)
def test_derivatives_match_autodiff(kind, dtype, reorth):
    # Reverse mode with a random cotangent on every output, and forward mode with
    # random tangents (not symmetric): the custom rule against JAX's autodiff of
    # the same scan.
    params, build, _, x0 = decomposition_problem(kind, dtype, n=N, hermitian=True)
    fs = [_lanczos(build, reorthogonalize=reorth, adjoint=a) for a in ADJOINTS]
    primals = (params, x0)
    cts = random_like(jr.key(3), jax.eval_shape(fs[0], *primals))
    tangents = random_like(jr.key(4), primals)

    @jax.jit
    def both(primals, cts, tangents):
        results = []
        for f in fs:
            out, vjp = jax.vjp(f, *primals)
            results.append((out, vjp(cts), jax.jvp(f, primals, tangents)[1]))
        return results

    (out, grads, t), (out_ad, grads_ad, t_ad) = both(primals, cts, tangents)
    for a, b in zip(*map(jax.tree.leaves, (out, out_ad)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    leaves = jax.tree.leaves(grads) + jax.tree.leaves(t)
    leaves_ad = jax.tree.leaves(grads_ad) + jax.tree.leaves(t_ad)
    for a, b in zip(leaves, leaves_ad, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10)
    # Close, not the same program: the custom rule ran.
    assert any(not np.array_equal(a, b) for a, b in zip(leaves, leaves_ad, strict=True))


@pytest.mark.parametrize(
    "kind,dtype,reorth",
    [
        # Every operator kind in both dtypes.
        ("dense", jnp.float64, False),
        ("dense", jnp.complex128, True),
        ("closure", jnp.float64, False),
        ("closure", jnp.complex128, True),
        ("bcoo", jnp.float64, True),
        ("bcoo", jnp.complex128, False),
    ],
)
def test_finite_differences(kind, dtype, reorth):
    # Second order is checked for `arnoldi`, through the same primitive.
    params, build, _, x0 = decomposition_problem(kind, dtype, n=4, hermitian=True)
    f = jax.jit(_lanczos(build, d=3, reorthogonalize=reorth))
    check_grads(f, (params, x0), order=1, modes=("fwd", "rev"))


def test_closed_form_gradients():
    A, x0 = _hermitian(jnp.float64)

    def parts(A, x0, reorth):
        dec = krylovjax.lanczos(A, x0, N, reorthogonalize=reorth)
        return dec.norm, jnp.sum(dec.diagonal), jnp.sum(jnp.sin(dec.basis))

    @jax.jit
    def grads(A, x0):
        return [jax.jacrev(parts, (0, 1))(A, x0, r) for r in (True, False)]

    for reorth, ((_, g_norm), (g_trace, _), (_, g_basis)) in zip(
        (True, False), grads(A, x0), strict=True
    ):
        np.testing.assert_allclose(g_norm, x0 / jnp.linalg.norm(x0), rtol=1e-12)
        # Q depends on the direction of x0 only.
        np.testing.assert_allclose(g_basis @ x0, 0, atol=1e-10)
        # At d = n, trace(T) = trace(Q^T A Q) = trace(A) while Q stays orthogonal:
        # for every perturbation of A with re-orthogonalisation, for symmetric
        # ones with the plain recurrence (which needs a symmetric A for that).
        g_sym = (g_trace + g_trace.T) / 2
        np.testing.assert_allclose(g_trace if reorth else g_sym, np.eye(N), atol=1e-9)


def test_forward_mode_matches_reverse_mode():
    A, x0 = _hermitian(jnp.float64, n=5)

    def f(A, x0):
        leaves = _lanczos(lambda p: p, d=3)(A, x0)
        return jnp.concatenate([jnp.ravel(leaf) for leaf in leaves])

    tangents = random_like(jr.key(5), (A, x0))

    @jax.jit
    def modes(A, x0, tangents):
        _, lin = jax.linearize(f, A, x0)
        return (
            jax.jacfwd(f, (0, 1))(A, x0),
            jax.jacrev(f, (0, 1))(A, x0),
            lin(*tangents),
            jax.jvp(f, (A, x0), tangents)[1],
        )

    fwd, rev, linearized, jvp = modes(A, x0, tangents)
    for a, b in zip(fwd, rev, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(linearized, jvp, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ transforms

BATCH = 2


def _loss(A, x0):
    return sum(jnp.sum(jnp.sin(leaf)) for leaf in _lanczos(lambda p: p)(A, x0))


def test_vmap_jit_and_grad_compose():
    A, _ = _hermitian(jnp.float64)
    xs = random_array(jr.key(6), (BATCH, N), jnp.float64)

    @jax.jit
    def transformed(A, xs):
        return (
            jax.vmap(_lanczos(lambda p: p), (None, 0))(A, xs),
            jax.grad(lambda A, xs: jnp.sum(jax.vmap(_loss, (None, 0))(A, xs)), (0, 1))(
                A, xs
            ),
            jax.vmap(jax.grad(_loss, (0, 1)), (None, 0))(A, xs),
        )

    @jax.jit
    def one_by_one(A, xs):
        return (
            [_lanczos(lambda p: p)(A, x) for x in xs],
            [jax.grad(_loss, (0, 1))(A, x) for x in xs],
        )

    values, grad_of_vmap, vmap_of_grad = transformed(A, xs)
    singles, grads = one_by_one(A, xs)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *singles)
    for a, b in zip(values, stacked, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    g_As = jnp.stack([g for g, _ in grads])
    g_x = jnp.stack([g for _, g in grads])
    np.testing.assert_allclose(grad_of_vmap[0], g_As.sum(0), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad_of_vmap[1], g_x, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(vmap_of_grad[0], g_As, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(vmap_of_grad[1], g_x, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------- breakdown


def _invariant_problem():
    """A symmetric A and an x0 in the span of two of its eigenvectors."""
    A, _ = _hermitian(jnp.float64, seed=8)
    _, V = np.linalg.eigh(np.asarray(A))
    return A, jnp.asarray(V[:, 1] + 2 * V[:, 4])


@pytest.mark.parametrize("reorth", [True, False])
def test_breakdown_at_an_invariant_subspace(reorth):
    A, x0 = _invariant_problem()
    d = 5
    fs = [_lanczos(lambda p: p, d, reorthogonalize=reorth, adjoint=a) for a in ADJOINTS]
    cts = random_like(jr.key(9), jax.eval_shape(fs[0], A, x0))

    @jax.jit
    def run(A, x0, cts):
        return [(f(A, x0), jax.vjp(f, A, x0)[1](cts)) for f in fs]

    (out, grads), (_, grads_ad) = run(A, x0, cts)
    Q, alpha, beta, r, _ = out
    # Two vectors span the invariant subspace: beta_1 = 0, everything later zero.
    assert beta[1] == 0 and np.all(beta[2:] == 0) and np.all(alpha[2:] == 0)
    assert np.all(Q[:, 2:] == 0) and np.all(r == 0)
    T = jnp.diag(alpha) + jnp.diag(beta, 1) + jnp.diag(beta, -1)
    np.testing.assert_allclose(A @ Q, Q @ T, atol=1e-12)
    ritz = np.linalg.eigvalsh(np.asarray(T[:2, :2]))
    np.testing.assert_allclose(ritz, np.linalg.eigvalsh(np.asarray(A))[[1, 4]])
    for g, g_ad in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ad), strict=True):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, g_ad, rtol=1e-8, atol=1e-8)


def test_zero_x0_gives_zeros_and_finite_derivatives():
    A, _ = _invariant_problem()
    x0 = jnp.zeros(N)
    fs = [_lanczos(lambda p: p, adjoint=a) for a in ADJOINTS]

    def derivatives(f, A, x0):
        grads = jax.grad(lambda A, x: _loss(A, x) + f(A, x)[4], (0, 1))(A, x0)
        return f(A, x0), grads, jax.jvp(f, (A, x0), (A, jnp.ones(N)))[1]

    @jax.jit
    def run(A, x0):
        return [derivatives(f, A, x0) for f in fs]

    for values, grads, tangents in run(A, x0):
        assert all(np.all(leaf == 0) for leaf in values)
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((grads, tangents)))


# ---------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    A, x0 = jnp.eye(3), jnp.ones(3)
    with pytest.raises(ValueError, match=r"`lanczos\(x0=...\)` must be one vector"):
        unchecked(krylovjax.lanczos)(A, jnp.ones((3, 2)), 2)
    with pytest.raises(ValueError, match=r"`lanczos\(d=...\)` must be at most n = 3"):
        krylovjax.lanczos(A, x0, 4)
    with pytest.raises(ValueError, match=r"`lanczos\(d=...\)` must be an int >= 1"):
        krylovjax.lanczos(A, x0, 0)
    with pytest.raises(ValueError, match=r"`lanczos\(A=...\)` must be a square"):
        unchecked(krylovjax.lanczos)(jnp.ones((3, 4)), x0, 2)
    with pytest.raises(TypeError, match=r"`lanczos\(reorthogonalize=...\)` must be"):
        unchecked(krylovjax.lanczos)(A, x0, 2, reorthogonalize=1)
    with pytest.raises(ValueError, match=r"`lanczos\(adjoint=...\)` must be one of"):
        unchecked(krylovjax.lanczos)(A, x0, 2, adjoint=None)


# ---------------------------------------------------------------------- memory


def _temp_bytes(d, adjoint, reorth, n=512):
    A, x0 = _hermitian(jnp.float64, n=n, seed=10)
    f = _lanczos(lambda p: p, d, reorthogonalize=reorth, adjoint=adjoint)
    grad = jax.grad(lambda A, x: sum(jnp.sum(jnp.sin(y)) for y in f(A, x)), (0, 1))
    compiled = jax.jit(grad).lower(A, x0).compile()
    stats = compiled.memory_analysis()
    if stats is None:
        pytest.skip("memory_analysis() returns None on this backend")
    return stats.temp_size_in_bytes


def test_reverse_pass_memory_is_linear_in_d():
    custom = {d: _temp_bytes(d, "custom_jvp", True) for d in (32, 64)}
    # With re-orthogonalisation autodiff saves the (n, d) basis buffer at every
    # step, O(n d^2).
    assert custom[64] < _temp_bytes(64, "autodiff", True) / 4
    assert custom[64] < 2.5 * custom[32]
