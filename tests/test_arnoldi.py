"""`krylovjax.arnoldi`: values, derivatives (three oracles), transforms, breakdown,
errors and the memory of the reverse pass."""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    DTYPES,
    arnoldi_numpy,
    decomposition_problem,
    lanczos_numpy,
    make_operator,
    random_array,
    random_like,
    unchecked,
    vjps,
)
from jax.experimental import sparse
from jax.test_util import check_grads

import krylovjax

N, D = 6, 4
ADJOINTS = ("custom_jvp", "autodiff")


def _tol(dtype):
    if jnp.finfo(dtype).bits <= 32:
        return {"rtol": 2e-4, "atol": 2e-5}
    return {"rtol": 1e-10, "atol": 1e-12}


def _arnoldi(build, d=D, **kwargs):
    """`(params, x0) -> arnoldi(build(params), x0, d, **kwargs)`, as a tuple."""

    def f(params, x0):
        dec = krylovjax.arnoldi(build(params), x0, d, **kwargs)
        return dec.basis, dec.hessenberg, dec.residual, dec.norm

    return f


def _check_decomposition(dec, A, x0, d, reorth):
    """Shapes, dtypes, the Arnoldi relation, orthonormality, the Hessenberg form,
    and agreement with the NumPy reference."""
    dtype = x0.dtype
    real = jnp.finfo(dtype).dtype
    assert dec.basis.shape == (N, d) and dec.basis.dtype == dtype
    assert dec.hessenberg.shape == (d, d) and dec.hessenberg.dtype == dtype
    assert dec.residual.shape == (N,) and dec.residual.dtype == dtype
    assert dec.norm.shape == () and dec.norm.dtype == real
    Q, H, r = (
        np.asarray(x, np.complex128) for x in (dec.basis, dec.hessenberg, dec.residual)
    )
    A = np.asarray(A, np.complex128)
    tol = _tol(dtype)
    atol = 10 * tol["atol"]
    np.testing.assert_allclose(Q.conj().T @ Q, np.eye(d), atol=atol)
    np.testing.assert_allclose(Q.conj().T @ r, 0, atol=atol)
    e_last = np.eye(d)[-1]
    np.testing.assert_allclose(A @ Q, Q @ H + np.outer(r, e_last), atol=atol)
    assert np.all(np.tril(H, -2) == 0)
    sub = np.diagonal(H, -1)
    assert np.all(sub.imag == 0) and np.all(sub.real >= 0)
    reference = arnoldi_numpy(A, x0, d, reorth)
    for got, want in zip((Q, H, r, dec.norm), reference, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, **tol)


def _decompose(A, x0, d, **kwargs):
    f = jax.jit(krylovjax.arnoldi, static_argnums=2, static_argnames=tuple(kwargs))
    return f(A, x0, d, **kwargs)


# ---------------------------------------------------------------------- values


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reorth", [True, False])
def test_values_dense(dtype, reorth):
    params, _, _, x0 = decomposition_problem("dense", dtype, n=N)
    dec = _decompose(params, x0, D, reorthogonalize=reorth)
    _check_decomposition(dec, params, x0, D, reorth)


@pytest.mark.parametrize(
    "kind,dtype",
    [("bcoo", jnp.complex128), ("closure", jnp.float32), ("module", jnp.complex64)],
)
def test_values_operator_kinds(kind, dtype):
    params, build, dense, x0 = decomposition_problem(kind, dtype, n=N)
    dec = jax.jit(lambda p, x: krylovjax.arnoldi(build(p), x, D))(params, x0)
    _check_decomposition(dec, dense(params), x0, D, True)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.complex128])
def test_full_dimension_reproduces_the_spectrum(dtype):
    params, _, _, x0 = decomposition_problem("dense", dtype, n=N)
    dec = _decompose(params, x0, N)
    np.testing.assert_allclose(dec.residual, 0, atol=1e-12)
    got = np.sort_complex(np.linalg.eigvals(np.asarray(dec.hessenberg)))
    want = np.sort_complex(np.linalg.eigvals(np.asarray(params)))
    np.testing.assert_allclose(got, want, atol=1e-10)


def test_depth_one_and_promotion():
    A, x0 = jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([3.0, 4.0])
    dec = krylovjax.arnoldi(A, x0, 1)
    np.testing.assert_allclose(dec.basis[:, 0], x0 / 5)
    np.testing.assert_allclose(dec.hessenberg, [[x0 @ A @ x0 / 25]])
    # A complex matrix and a real x0: a complex decomposition with a real norm.
    dec = krylovjax.arnoldi(A.astype(jnp.complex128) * 1j, x0, 2)
    assert dec.basis.dtype == jnp.complex128 and dec.norm.dtype == jnp.float64


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
    # random tangents: the custom rule against JAX's autodiff of the same scan.
    params, build, _, x0 = decomposition_problem(kind, dtype, n=N)
    fs = [_arnoldi(build, reorthogonalize=reorth, adjoint=a) for a in ADJOINTS]
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
    "kind,dtype,reorth,order",
    [
        # Every operator kind in both dtypes, second order once.
        ("closure", jnp.float64, True, 2),
        ("closure", jnp.complex128, False, 1),
        ("dense", jnp.float64, True, 1),
        ("dense", jnp.complex128, False, 1),
        ("bcoo", jnp.float64, False, 1),
        ("bcoo", jnp.complex128, True, 1),
    ],
)
def test_finite_differences(kind, dtype, reorth, order):
    params, build, _, x0 = decomposition_problem(kind, dtype, n=4)
    f = jax.jit(_arnoldi(build, d=3, reorthogonalize=reorth))
    check_grads(f, (params, x0), order=order, modes=("fwd", "rev"))


def test_closed_form_gradients():
    params, _, _, x0 = decomposition_problem("dense", jnp.float64, n=N)

    def parts(A, x0, reorth):
        dec = krylovjax.arnoldi(A, x0, N, reorthogonalize=reorth)
        return dec.norm, jnp.trace(dec.hessenberg), jnp.sum(jnp.sin(dec.basis))

    @jax.jit
    def grads(A, x0):
        return [jax.jacrev(parts, (0, 1))(A, x0, r) for r in (True, False)]

    for (_, g_norm), (g_trace, _), (_, g_basis) in grads(params, x0):
        # d ||x0|| = x0 / ||x0||; at d = n, trace(H) = trace(Q^T A Q) = trace(A);
        # and Q depends on the direction of x0 only, so its gradient is orthogonal
        # to x0.
        np.testing.assert_allclose(g_norm, x0 / jnp.linalg.norm(x0), rtol=1e-12)
        np.testing.assert_allclose(g_trace, np.eye(N), atol=1e-10)
        np.testing.assert_allclose(g_basis @ x0, 0, atol=1e-10)


def test_forward_mode_matches_reverse_mode():
    params, _, _, x0 = decomposition_problem("dense", jnp.float64, n=5)

    def f(A, x0):
        leaves = _arnoldi(lambda p: p, d=3)(A, x0)
        return jnp.concatenate([jnp.ravel(leaf) for leaf in leaves])

    tangents = random_like(jr.key(5), (params, x0))

    @jax.jit
    def modes(A, x0, tangents):
        _, lin = jax.linearize(f, A, x0)
        return (
            jax.jacfwd(f, (0, 1))(A, x0),
            jax.jacrev(f, (0, 1))(A, x0),
            lin(*tangents),
            jax.jvp(f, (A, x0), tangents)[1],
        )

    fwd, rev, linearized, jvp = modes(params, x0, tangents)
    for a, b in zip(fwd, rev, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(linearized, jvp, rtol=1e-10, atol=1e-12)


def test_numpy_cotangent_outside_jit():
    A, x0 = jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([1.0, 1.0])
    out, vjp = jax.vjp(_arnoldi(lambda p: p, d=2), A, x0)
    g_A, g_x0 = vjp(jax.tree.map(lambda y: np.ones(y.shape, y.dtype), out))
    assert g_A.shape == (2, 2) and np.all(np.isfinite(g_x0))


# ------------------------------------------------------------------ transforms

BATCH = 2


def _loss(A, x0):
    return sum(jnp.sum(jnp.sin(leaf)) for leaf in _arnoldi(lambda p: p)(A, x0))


def test_vmap_jit_and_grad_compose():
    params, _, _, _ = decomposition_problem("dense", jnp.float64, n=N)
    xs = random_array(jr.key(6), (BATCH, N), jnp.float64)
    As = random_array(jr.key(7), (BATCH, N, N), jnp.float64)

    @jax.jit
    def transformed(A, xs, As):
        return (
            jax.vmap(_arnoldi(lambda p: p), (None, 0))(A, xs),
            jax.grad(lambda A, xs: jnp.sum(jax.vmap(_loss, (None, 0))(A, xs)), (0, 1))(
                A, xs
            ),
            jax.vmap(jax.grad(_loss, (0, 1)), (None, 0))(A, xs),
            jax.grad(lambda As: jnp.sum(jax.vmap(_loss, (0, None))(As, xs[0])))(As),
        )

    @jax.jit
    def one_by_one(A, xs, As):
        return (
            [_arnoldi(lambda p: p)(A, x) for x in xs],
            [jax.grad(_loss, (0, 1))(A, x) for x in xs],
            [jax.grad(_loss)(B, xs[0]) for B in As],
        )

    values, grad_of_vmap, vmap_of_grad, grad_of_vmap_A = transformed(params, xs, As)
    singles, grads, grads_A = one_by_one(params, xs, As)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *singles)
    for a, b in zip(values, stacked, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    g_A = sum(g for g, _ in grads)
    g_x = jnp.stack([g for _, g in grads])
    np.testing.assert_allclose(grad_of_vmap[0], g_A, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad_of_vmap[1], g_x, rtol=1e-10, atol=1e-12)
    g_As = jnp.stack([g for g, _ in grads])
    np.testing.assert_allclose(vmap_of_grad[0], g_As, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(vmap_of_grad[1], g_x, rtol=1e-10, atol=1e-12)
    for g, want in zip(grad_of_vmap_A, grads_A, strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------- breakdown


def _invariant_problem():
    """A symmetric A and an x0 in the span of two of its eigenvectors."""
    M = random_array(jr.key(8), (N, N), jnp.float64)
    A = (M + M.T) / 2
    _, V = np.linalg.eigh(np.asarray(A))
    return A, jnp.asarray(V[:, 1] + 2 * V[:, 4])


@pytest.mark.parametrize("reorth", [True, False])
def test_breakdown_at_an_invariant_subspace(reorth):
    A, x0 = _invariant_problem()
    d = 5
    fs = [_arnoldi(lambda p: p, d, reorthogonalize=reorth, adjoint=a) for a in ADJOINTS]
    (out, grads), (_, grads_ad) = vjps(fs, (A, x0), jr.key(9))
    Q, H, r, _ = out
    # Two vectors span the invariant subspace: H[2, 1] = 0, everything later zero.
    assert H[2, 1] == 0
    assert np.all(Q[:, 2:] == 0) and np.all(H[:, 2:] == 0) and np.all(r == 0)
    np.testing.assert_allclose(A @ Q, Q @ H, atol=1e-12)
    ritz = np.sort(np.linalg.eigvals(np.asarray(H[:2, :2])).real)
    np.testing.assert_allclose(ritz, np.linalg.eigvalsh(np.asarray(A))[[1, 4]])
    for g, g_ad in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ad), strict=True):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, g_ad, rtol=1e-8, atol=1e-8)


def test_zero_x0_gives_zeros_and_finite_derivatives():
    A, _ = _invariant_problem()
    x0 = jnp.zeros(N)
    fs = [_arnoldi(lambda p: p, adjoint=a) for a in ADJOINTS]

    def derivatives(f, A, x0):
        grads = jax.grad(lambda A, x: _loss(A, x) + f(A, x)[3], (0, 1))(A, x0)
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
    with pytest.raises(ValueError, match=r"`arnoldi\(x0=...\)` must be one vector"):
        unchecked(krylovjax.arnoldi)(A, jnp.ones((3, 2)), 2)
    with pytest.raises(ValueError, match=r"`arnoldi\(d=...\)` must be at most n = 3"):
        krylovjax.arnoldi(A, x0, 4)
    with pytest.raises(ValueError, match=r"`arnoldi\(d=...\)` must be an int >= 1"):
        krylovjax.arnoldi(A, x0, 0)
    with pytest.raises(ValueError, match=r"`arnoldi\(A=...\)` must be a square"):
        unchecked(krylovjax.arnoldi)(jnp.ones((3, 4)), x0, 2)
    with pytest.raises(TypeError, match=r"`arnoldi\(reorthogonalize=...\)` must be"):
        unchecked(krylovjax.arnoldi)(A, x0, 2, reorthogonalize="yes")
    with pytest.raises(ValueError, match=r"`arnoldi\(adjoint=...\)` must be one of"):
        unchecked(krylovjax.arnoldi)(A, x0, 2, adjoint="custom_vjp")


# ---------------------------------------------------------------------- memory


def _temp_bytes(d, adjoint, reorth, n=512):
    A = random_array(jr.key(10), (n, n), jnp.float64) / np.sqrt(n)
    x0 = random_array(jr.key(11), (n,), jnp.float64)
    f = _arnoldi(lambda p: p, d, reorthogonalize=reorth, adjoint=adjoint)
    grad = jax.grad(lambda A, x: sum(jnp.sum(jnp.sin(y)) for y in f(A, x)), (0, 1))
    compiled = jax.jit(grad).lower(A, x0).compile()
    stats = compiled.memory_analysis()
    if stats is None:
        pytest.skip("memory_analysis() returns None on this backend")
    return stats.temp_size_in_bytes


def test_reverse_pass_memory_is_linear_in_d():
    custom = {d: _temp_bytes(d, "custom_jvp", True) for d in (32, 64)}
    autodiff = _temp_bytes(64, "autodiff", True)
    # Autodiff saves the (n, d) basis buffer at every step: O(n d^2).
    assert custom[64] < autodiff / 4
    assert custom[64] < 2.5 * custom[32]


# ------------------------------------------------------- regressions, adversarial


@pytest.mark.parametrize("decompose", [krylovjax.arnoldi, krylovjax.lanczos])
def test_jacfwd_in_x0_matches_jacrev(decompose):
    # Forward mode in the starting vector alone: the tangent primitive is batched
    # over `x0`'s tangents while the decomposition itself is not.
    params, _, _, x0 = decomposition_problem("dense", jnp.float64, n=N)
    A = params + params.T

    def f(x):
        dec = decompose(A, x, D)
        return dec.basis, dec.residual

    fwd = jax.jacfwd(f)(x0)
    rev = jax.jacrev(f)(x0)
    for a, b in zip(fwd, rev, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("decompose", [krylovjax.arnoldi, krylovjax.lanczos])
@pytest.mark.parametrize("where", ["A", "x0"])
def test_nan_input_is_not_taken_for_a_breakdown(decompose, where):
    # A NaN must reach the output, not be masked to zero vectors as a breakdown.
    params, _, _, x0 = decomposition_problem("dense", jnp.float64, n=N)
    A = params + params.T
    if where == "A":
        A = A.at[0, 0].set(jnp.nan)
    else:
        x0 = x0.at[0].set(jnp.nan)
    dec = decompose(A, x0, D)
    assert np.isnan(np.asarray(dec.basis)).any()
    assert np.isnan(np.asarray(dec.residual)).any()


def _parts(decompose, build, d, reorth, adjoint):
    def f(params, x0):
        dec = decompose(build(params), x0, d, reorthogonalize=reorth, adjoint=adjoint)
        return jax.tree.leaves(dec)

    return f


@pytest.mark.parametrize("decompose", [krylovjax.arnoldi, krylovjax.lanczos])
@pytest.mark.parametrize(
    "kind,dtype,reorth",
    [
        ("dense", jnp.float64, True),
        ("dense", jnp.float64, False),
        ("bcoo", jnp.float64, True),
        ("dense", jnp.complex128, True),
    ],
)
def test_long_bases_match_autodiff(decompose, kind, dtype, reorth):
    # Long enough that the reverse pass updates its buffer in blocks of rows, with a
    # last block that overlaps the one before (d = 19); and for Arnoldi and Lanczos
    # without re-orthogonalisation, A Q comes from the outputs rather than from
    # products with A.
    n, d = 24, 19
    params, build, _, x0 = decomposition_problem(
        kind, dtype, n=n, hermitian=decompose is krylovjax.lanczos
    )
    fs = [_parts(decompose, build, d, reorth, a) for a in ADJOINTS]
    cts = random_like(jr.key(5), jax.eval_shape(fs[0], params, x0))
    grads = [
        jax.jit(lambda p, x, f=f: jax.vjp(f, p, x)[1](cts))(params, x0) for f in fs
    ]
    for a, b in zip(*map(jax.tree.leaves, grads), strict=True):
        # Normwise: without re-orthogonalisation some gradient entries reach 1e4
        # (divisions by small beta_k), and the rounding of those sets the scale.
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-9 * np.max(np.abs(b)))
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(*map(jax.tree.leaves, grads), strict=True)
    )


@pytest.mark.parametrize("decompose", [krylovjax.arnoldi, krylovjax.lanczos])
@pytest.mark.parametrize("reorth", [True, False])
def test_second_derivatives_match_autodiff(decompose, reorth):
    # Both compositions of forward and reverse mode differentiate the hand-written
    # reverse pass itself: it must stay differentiable in reverse mode too.
    n, d = 12, 10
    params, _, _, x0 = decomposition_problem("dense", jnp.float64, n=n)
    A = params + params.T

    def loss(adjoint):
        def f(x):
            parts = _parts(decompose, lambda p: p, d, reorth, adjoint)(A, x)
            return sum(jnp.sum(jnp.sin(p)) for p in parts)

        return f

    rev_rev = jax.jacrev(jax.jacrev(loss("custom_jvp")))(x0)
    fwd_rev = jax.hessian(loss("custom_jvp"))(x0)
    want = jax.hessian(loss("autodiff"))(x0)
    np.testing.assert_allclose(rev_rev, want, rtol=1e-7, atol=1e-8)
    np.testing.assert_allclose(fwd_rev, want, rtol=1e-7, atol=1e-8)


# ------------------------------------------------------- range and precision

# Far beyond the square root of the dtype's range, where squares over- or underflow.
SCALES = {jnp.float32: 1e20, jnp.float64: 1e200}


def _in_unscaled_units(decompose, A, x0, scale_A, scale_x0, **kwargs):
    """The decomposition's arrays, each divided by the factor that scaling `A` by
    `scale_A` and `x0` by `scale_x0` multiplies it by."""
    dec = decompose(A, x0, D, **kwargs)
    with_A = ("hessenberg", "diagonal", "off_diagonal", "residual")
    parts = [getattr(dec, name) / scale_A for name in with_A if hasattr(dec, name)]
    return [dec.basis, *parts, dec.norm / scale_x0]


@pytest.mark.parametrize("decompose", [krylovjax.arnoldi, krylovjax.lanczos])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_scaled_problem_gives_the_scaled_decomposition(decompose, dtype):
    # The norms must not square the entries unscaled: 1e20 ** 2 overflows float32
    # and 1e-20 ** 2 underflows it, as 1e200 does float64; nor may the derivatives
    # square a norm (JAX's rule for a quotient does). `A` or `x0` scaled up or
    # down, one program for all (the scales are arguments).
    params, _, _, x0 = decomposition_problem("dense", dtype, n=N, hermitian=True)
    one = jnp.ones((), dtype)
    cts = random_like(
        jr.key(12),
        jax.eval_shape(
            lambda A, x: _in_unscaled_units(decompose, A, x, 1, 1), params, x0
        ),
    )

    @jax.jit
    def run(A, x0, scale_A, scale_x0):
        def loss(A, x0, adjoint):
            parts = _in_unscaled_units(
                decompose, A, x0, scale_A, scale_x0, adjoint=adjoint
            )
            return sum(jnp.sum(c * p) for c, p in zip(cts, parts, strict=True))

        parts = _in_unscaled_units(decompose, A, x0, scale_A, scale_x0)
        grads = [jax.grad(loss, (0, 1))(A, x0, adjoint) for adjoint in ADJOINTS]
        return parts, grads

    want, (want_grads, _) = run(params, x0, one, one)
    tol = _tol(dtype)
    for scale in (SCALES[dtype], 1 / SCALES[dtype]):
        s = jnp.asarray(scale, dtype)
        for scale_A, scale_x0 in ((s, one), (one, s)):
            got, grads = run(scale_A * params, scale_x0 * x0, scale_A, scale_x0)
            for a, b in zip(got, want, strict=True):
                np.testing.assert_allclose(a, b, **tol)
            # Both rules' gradients are the unscaled ones divided by the scale.
            for rule in grads:
                for g, w, s_g in zip(
                    rule, want_grads, (scale_A, scale_x0), strict=True
                ):
                    assert np.all(np.isfinite(g))
                    np.testing.assert_allclose(g * s_g, w, **tol)


def _spd_with_spectrum(low, high, n, seed):
    """A symmetric positive definite (n, n) matrix with eigenvalues evenly spaced in
    [low, high] and random orthogonal eigenvectors, in float64."""
    V, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, n)))
    return V @ np.diag(np.linspace(low, high, n)) @ V.T


def _full_operator(kind, A):
    """`(params, build)` for an operator of `kind` whose matrix is all of `A`."""
    if kind == "bcoo":
        B = sparse.BCOO.fromdense(A)
        return B.data, lambda data: sparse.BCOO((data, B.indices), shape=B.shape)
    return make_operator(kind, A)


def _outputs(dec):
    small = dec.hessenberg if isinstance(dec, krylovjax.Arnoldi) else dec.matrix()
    return [dec.basis, small, dec.residual, dec.norm]


def _values_and_gradients(decompose, build, cts, d):
    """A jitted `(params, x0) -> (outputs, gradients)` of `sum(cts * outputs)`."""

    def loss(params, x0):
        outputs = _outputs(decompose(build(params), x0, d))
        return sum(
            jnp.sum(c.astype(y.dtype) * y) for c, y in zip(cts, outputs, strict=True)
        )

    @jax.jit
    def run(params, x0):
        outputs = _outputs(decompose(build(params), x0, d))
        return outputs, jax.grad(loss, (0, 1))(params, x0)

    return run


@pytest.mark.parametrize(
    "decompose,kind,dtype",
    # Both decompositions in both half dtypes, each operator kind once.
    [
        (krylovjax.arnoldi, "dense", jnp.bfloat16),
        (krylovjax.arnoldi, "closure", jnp.float16),
        (krylovjax.lanczos, "bcoo", jnp.bfloat16),
        (krylovjax.lanczos, "dense", jnp.float16),
    ],
)
def test_half_precision_computes_in_float32(decompose, kind, dtype):
    # In the half dtype itself, a breakdown threshold of 100 epsilons would be 0.78
    # ||A q_k|| in bfloat16, and this well-conditioned problem would stop after
    # one vector of eight.
    n = 8
    A = jnp.asarray(_spd_with_spectrum(10, 12, n, seed=0), dtype)
    x0 = jnp.asarray(np.random.default_rng(1).standard_normal(n), dtype)
    params, build = _full_operator(kind, A)
    shapes = [(n, n), (n, n), (n,), ()]
    cts = [
        random_array(k, s, dtype)
        for k, s in zip(jr.split(jr.key(13), 4), shapes, strict=True)
    ]
    outputs, grads = _values_and_gradients(decompose, build, cts, n)(params, x0)
    assert all(y.dtype == dtype for y in outputs)
    Q, small, r, _ = (np.asarray(y, np.float64) for y in outputs)
    A64, x64 = np.asarray(A, np.float64), np.asarray(x0, np.float64)
    eps = float(jnp.finfo(dtype).eps)
    scale = np.linalg.norm(A64, 2)
    # All eight vectors, orthonormal and satisfying A Q = Q H + r e^T to a few
    # epsilons of the half dtype (the outputs are rounded to it).
    np.testing.assert_allclose(Q.T @ Q, np.eye(n), atol=2 * eps)
    relation = Q @ small + np.outer(r, np.eye(n)[-1])
    np.testing.assert_allclose(A64 @ Q, relation, atol=2 * eps * scale)
    if decompose is krylovjax.arnoldi:
        reference = arnoldi_numpy(A64, x64, n)[1]
    else:
        _, alpha, beta, _, _ = lanczos_numpy(A64, x64, n)
        reference = np.diag(alpha) + np.diag(beta, 1) + np.diag(beta, -1)
    np.testing.assert_allclose(small, reference, atol=4 * eps * scale)
    # The gradient is that of the float32 computation (the callable applied in its
    # own dtype), rounded to the half dtype.
    if kind == "closure":
        params32 = params

        def build32(p):
            return lambda v: build(p)(v.astype(dtype)).astype(jnp.float32)

    else:
        params32, build32 = params.astype(jnp.float32), build
    run32 = _values_and_gradients(decompose, build32, cts, n)
    _, grads32 = run32(params32, x0.astype(jnp.float32))
    for g, g32 in zip(grads, grads32, strict=True):
        assert g.dtype == dtype
        np.testing.assert_allclose(
            np.asarray(g, np.float64),
            np.asarray(g32.astype(dtype), np.float64),
            rtol=eps,
            atol=eps * float(np.max(np.abs(g32))),
        )
