"""`krylovjax.arnoldi` and `krylovjax.lanczos`: values, derivatives (three oracles),
transforms, breakdown, errors, range and precision, and the memory of the reverse
pass.

What the two share is tested for both (`method`): Lanczos on Hermitian matrices,
Arnoldi on general (non-normal) ones unless a test says otherwise. What belongs to
one of them (the Hessenberg form, a real symmetric tridiagonal `T`, Lanczos's loss
of orthogonality) is a branch of the shared check or a test of its own.

Compiling is what these tests spend their time on (about a second for a
decomposition, a few for its derivatives), so a test compiles one program per
method and calls it for each of its checks: the derivatives of a real problem are
checked against autodiff, finite differences and closed forms, at a breakdown, at a
zero `x0`, at extreme scales and with NaN inputs, all with one program. Each
setting is taken where it reaches a path that no other does: the operator kinds
(dense, BCOO, callable, module), real and complex dtypes, re-orthogonalisation on
and off (each method has both, between the real problem and the long basis), and a
basis short enough for the reverse pass to update its buffer at once or long enough
for it to work in blocks of rows.
"""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    DECOMPOSITIONS,
    arnoldi_numpy,
    check_finite_differences,
    decompose,
    decomposition_fn,
    decomposition_numpy,
    decomposition_problem,
    full_operator,
    lanczos_numpy,
    random_array,
    random_like,
    scalar_loss,
    small_matrix,
    spd,
    temp_bytes,
    unchecked,
    value_vjp_jvp,
)

import krylovjax

N, D = 6, 4
ADJOINTS = ("custom_jvp", "autodiff")

method_param = pytest.mark.parametrize("method", DECOMPOSITIONS)
DECOMPOSITION_CLASSES = {"arnoldi": krylovjax.Arnoldi, "lanczos": krylovjax.Lanczos}

# Re-orthogonalisation in the real problem and in the long basis: each method has
# both settings between the two. Lanczos's reverse pass works in blocks of rows only
# with re-orthogonalisation (the three-term recurrence has no Gram-Schmidt
# coefficients), so the long basis has it.
REAL_REORTH = {"arnoldi": True, "lanczos": False}
LONG_REORTH = {"arnoldi": False, "lanczos": True}

# Longer than the reverse pass's blocks of rows (`OUTER_ROWS` = 8), with a last
# block that overlaps the one before; the real problem (d = n = 6) takes the short
# path, where the whole buffer is updated at once.
LONG_N, LONG_D = 12, 10


def _tol(dtype):
    if jnp.finfo(dtype).bits <= 32:
        return {"rtol": 2e-4, "atol": 2e-5}
    return {"rtol": 1e-10, "atol": 1e-12}


def _problem(method, kind, dtype, n=N, seed=0):
    """`decomposition_problem`, Hermitian for Lanczos."""
    return decomposition_problem(
        kind, dtype, n=n, hermitian=method == "lanczos", seed=seed
    )


def _loss(method):
    """`(A, x0) -> ` the sum of `sin` of every output of the decomposition."""
    f = decomposition_fn(method, D)
    return lambda A, x0: scalar_loss(f(A, x0))


def _decomposition(method, leaves):
    """The `Arnoldi` or `Lanczos` of the arrays that `decomposition_fn` returns."""
    return DECOMPOSITION_CLASSES[method](*leaves)


def _check_decomposition(method, dec, A, x0, d, reorth):
    """Shapes, dtypes, the relation A Q = Q S + r e^T, orthonormality, the form of
    S (upper Hessenberg; for Lanczos real symmetric tridiagonal), and agreement
    with the NumPy reference."""
    dtype = x0.dtype
    n = x0.shape[0]
    real = jnp.finfo(dtype).dtype
    S = np.asarray(small_matrix(dec))
    assert dec.basis.shape == (n, d) and dec.basis.dtype == dtype
    assert dec.residual.shape == (n,) and dec.residual.dtype == dtype
    assert dec.norm.shape == () and dec.norm.dtype == real
    assert S.shape == (d, d)
    sub = np.diagonal(S, -1)
    assert np.all(np.tril(S, -2) == 0)
    assert np.all(sub.imag == 0) and np.all(sub.real >= 0)
    if method == "arnoldi":
        assert S.dtype == dtype
    else:
        assert dec.diagonal.shape == (d,) and dec.diagonal.dtype == real
        assert dec.off_diagonal.shape == (d - 1,) and dec.off_diagonal.dtype == real
        assert S.dtype == real
        np.testing.assert_array_equal(S, S.T)
    Q, r = (np.asarray(x, np.complex128) for x in (dec.basis, dec.residual))
    A = np.asarray(A, np.complex128)
    tol = _tol(dtype)
    atol = 10 * tol["atol"]
    np.testing.assert_allclose(Q.conj().T @ Q, np.eye(d), atol=atol)
    np.testing.assert_allclose(Q.conj().T @ A @ Q, S, atol=atol)
    if method == "arnoldi":
        np.testing.assert_allclose(Q.conj().T @ r, 0, atol=atol)
    e_last = np.eye(d)[-1]
    np.testing.assert_allclose(A @ Q, Q @ S + np.outer(r, e_last), atol=atol)
    reference = decomposition_numpy(method, A, x0, d, reorth)
    for got, want in zip(jax.tree.leaves(dec), reference, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, **tol)


def _assert_close(got, want, err_msg="", **tol):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype, err_msg
        np.testing.assert_allclose(a, b, err_msg=err_msg, **tol)


def _differ(got, want):
    """Whether some array of `got` is not bitwise that of `want`."""
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    return any(not np.array_equal(a, b) for a, b in pairs)


# ---------------------------------------------------------------------- values

# (kind, dtype, reorthogonalize): the single-precision dtypes, a module and a
# callable. Dense, BCOO and closure operators in float64 and complex128 are
# checked against the NumPy reference below, in the real problem and in the long
# basis.
VALUE_CASES = [
    ("closure", jnp.float32, True),
    ("module", jnp.complex64, False),
]


@method_param
def test_values(method):
    problems = [_problem(method, kind, dtype) for kind, dtype, _ in VALUE_CASES]
    # Depth one, and a complex (Hermitian) matrix with a real x0: a complex
    # decomposition with a real norm.
    A, x0 = jnp.array([[1.0, 2.0], [2.0, 4.0]]), jnp.array([3.0, 4.0])
    Ac = jnp.array([[1.0, 2.0 + 1.0j], [2.0 - 1.0j, 4.0]])

    @jax.jit
    def run(params, x0s, A, Ac, x0):
        decs = [
            decompose(method, build(p), x, D, reorthogonalize=reorth)
            for p, x, (_, build, _, _), (_, _, reorth) in zip(
                params, x0s, problems, VALUE_CASES, strict=True
            )
        ]
        return decs, decompose(method, A, x0, 1), decompose(method, Ac, x0, 2)

    decs, dec, dec_c = run(
        [p[0] for p in problems], [p[3] for p in problems], A, Ac, x0
    )
    for dec_i, (params, _, dense, x0_i), (_, _, reorth) in zip(
        decs, problems, VALUE_CASES, strict=True
    ):
        _check_decomposition(method, dec_i, dense(params), x0_i, D, reorth)
    np.testing.assert_allclose(dec.basis[:, 0], x0 / 5)
    np.testing.assert_allclose(small_matrix(dec), [[x0 @ A @ x0 / 25]])
    assert dec_c.basis.dtype == jnp.complex128 and dec_c.norm.dtype == jnp.float64
    _check_decomposition(method, dec_c, Ac, x0.astype(jnp.complex128), 2, True)


def test_lanczos_reorthogonalization_keeps_the_basis_orthonormal():
    # Widely spread eigenvalues: the first Ritz values converge within a few
    # steps, and the plain recurrence then loses orthogonality (Paige).
    n = 40
    A = jnp.diag(jnp.asarray(np.geomspace(1.0, 1e4, n)))
    x0 = jnp.ones(n)

    @jax.jit
    def bases(A, x0):
        return [
            krylovjax.lanczos(A, x0, n, reorthogonalize=r).basis for r in (True, False)
        ]

    loss = [np.abs(np.asarray(Q).T @ Q - np.eye(n)).max() for Q in bases(A, x0)]
    assert loss[0] < 1e-12 < 1e-3 < loss[1]


def test_lanczos_stays_orthonormal_in_float32_near_an_invariant_space():
    # An RBF kernel plus a small noise (300 points in the unit square,
    # lengthscale 0.2): once the few dozen large eigenvalues have converged, each
    # step's remainder is a small part of the vector, and one Gram-Schmidt pass
    # against the basis left components along it of the size of what remained.
    # In float32 that lost orthogonality (0.04 here, 1 and a wrong solve at
    # (400, 150)); the second pass it now takes there keeps it.
    n, d = 300, 120
    rng = np.random.default_rng(0)
    points = rng.uniform(size=(n, 2))
    squared = np.sum((points[:, None] - points[None]) ** 2, axis=-1)
    A = jnp.asarray(np.exp(-squared / (2 * 0.2**2)) + 0.01 * np.eye(n), jnp.float32)
    x0 = jnp.asarray(rng.standard_normal(n), jnp.float32)

    @jax.jit
    def run(A, x0):
        basis = krylovjax.lanczos(A, x0, d).basis
        return basis, krylovjax.funm_action(lambda x: 1 / x, A, x0, d, method="lanczos")

    basis, y = run(A, x0)
    basis = np.asarray(basis, np.float64)
    assert np.abs(basis.T @ basis - np.eye(d)).max() < 1e-5
    want = np.linalg.solve(np.asarray(A, np.float64), np.asarray(x0, np.float64))
    error = np.linalg.norm(np.asarray(y, np.float64) - want) / np.linalg.norm(want)
    assert error < 1e-2  # 1.3e-3; 0.10 with one pass at (400, 150)


# ------------------------------------------------------------- the real problem

# Eigenvalues of a non-normal matrix are sensitive to its rounding.
SPECTRUM_ATOL = {"arnoldi": 1e-10, "lanczos": 1e-12}

# Far beyond the square root of float64's range, where squares over- or underflow.
SCALE = 1e200


def _invariant_problem():
    """A symmetric A and an x0 in the span of two of its eigenvectors."""
    A, _, _, _ = decomposition_problem(
        "dense", jnp.float64, n=N, hermitian=True, seed=8
    )
    _, V = np.linalg.eigh(np.asarray(A))
    return A, jnp.asarray(V[:, 1] + 2 * V[:, 4])


def _in_unscaled_units(leaves, scale_A, scale_x0):
    """The decomposition's arrays (or their cotangents), each divided by the factor
    that scaling `A` by `scale_A` and `x0` by `scale_x0` multiplies it by: the
    basis by none, the norm by `scale_x0`, every other array by `scale_A`."""
    basis, *with_A, norm = leaves
    return [basis, *(x / scale_A for x in with_A), norm / scale_x0]


@method_param
def test_real_problem_derivatives_breakdowns_and_range(method):
    # A callable operator in float64 at d = n, one program: the values, and the
    # VJP with a random cotangent on every output and the JVP along random
    # tangents (for Lanczos not symmetric) by the custom rule and by JAX's
    # autodiff of the same scan, and the custom JVP in x0 alone (the operator's
    # tangent a symbolic zero). It is called for each check below.
    reorth = REAL_REORTH[method]
    params, build, _, x0 = _problem(method, "closure", jnp.float64)
    fs = {
        adjoint: decomposition_fn(
            method, N, build, reorthogonalize=reorth, adjoint=adjoint
        )
        for adjoint in ADJOINTS
    }
    tangents = random_like(jr.key(4), (params, x0))
    cts = random_like(jr.key(3), jax.eval_shape(fs["custom_jvp"], params, x0))

    @jax.jit
    def run(p, x0, tangents, cts):
        out = {a: value_vjp_jvp(f, (p, x0), tangents, cts) for a, f in fs.items()}
        f = fs["custom_jvp"]
        out["x0 alone"] = jax.jvp(lambda x: f(p, x), (x0,), (tangents[1],))[1]
        return out

    # Values at d = n against NumPy: the residual vanishes and S has A's spectrum.
    out = run(params, x0, tangents, cts)
    dec = _decomposition(method, out["custom_jvp"][0])
    _check_decomposition(method, dec, params, x0, N, reorth)
    np.testing.assert_allclose(dec.residual, 0, atol=1e-12)
    got = np.sort_complex(np.linalg.eigvals(np.asarray(small_matrix(dec))))
    want = np.sort_complex(np.linalg.eigvals(np.asarray(params)))
    np.testing.assert_allclose(got, want, atol=SPECTRUM_ATOL[method])

    # Autodiff: the same values, close derivatives, not the same program (the
    # custom rule ran).
    (values, grads, t), (values_ad, grads_ad, t_ad) = (out[a] for a in ADJOINTS)
    _assert_close(values, values_ad, rtol=1e-12, atol=1e-12)
    _assert_close((grads, t), (grads_ad, t_ad), rtol=1e-9, atol=1e-10)
    assert _differ((grads, t), (grads_ad, t_ad))
    zero_A = (jnp.zeros_like(params), tangents[1])
    want = run(params, x0, zero_A, cts)["autodiff"][2]
    _assert_close(out["x0 alone"], want, rtol=1e-9, atol=1e-10)

    # Finite differences, forward and reverse mode, with a step of 1e-5: at d = n
    # the default 1e-4 leaves a truncation error of up to 1e-3 relative (the last
    # vectors are the most sensitive to A).
    def derivatives(args, tangents, cts):
        return run(*args, tangents, cts)["custom_jvp"]

    check_finite_differences(fs["custom_jvp"], derivatives, (params, x0), eps=1e-5)

    # Closed forms. d ||x0|| = x0 / ||x0||; Q depends on the direction of x0 only,
    # so its gradient is orthogonal to x0; at d = n, trace(S) = trace(Q^H A Q) =
    # trace(A) while Q stays unitary: its gradient is the identity for every
    # perturbation of A, except that Lanczos's plain recurrence needs a symmetric A
    # (and perturbation) for that.
    zeros = tuple(jnp.zeros_like(c) for c in cts)
    basis, *_, norm = zeros
    trace = jnp.ones(N) if method == "lanczos" else jnp.eye(N)
    closed = {
        "norm": (*zeros[:-1], jnp.ones_like(norm)),
        "basis": (jnp.cos(out["custom_jvp"][0][0]), *zeros[1:]),
        "trace": (basis, trace, *zeros[2:]),
    }
    g = {k: run(params, x0, tangents, ct)["custom_jvp"][1] for k, ct in closed.items()}
    np.testing.assert_allclose(g["norm"][1], x0 / jnp.linalg.norm(x0), rtol=1e-12)
    np.testing.assert_allclose(g["basis"][1] @ x0, 0, atol=1e-10)
    g_trace = g["trace"][0]
    if method == "lanczos" and not reorth:
        g_trace = (g_trace + g_trace.T) / 2
    np.testing.assert_allclose(g_trace, np.eye(N), atol=1e-10)

    # Breakdown: x0 in an invariant subspace of dimension two. S[2, 1] = 0
    # (H[2, 1], or beta_1), every later column of Q and S is zero, the residual is
    # the rounding-sized remainder of that step, and both rules' derivatives are
    # finite and agree.
    A, x_inv = _invariant_problem()
    out = run(A, x_inv, tangents, cts)
    Q, *_, r, _ = out["custom_jvp"][0]
    S = small_matrix(_decomposition(method, out["custom_jvp"][0]))
    assert S[2, 1] == 0
    assert np.all(Q[:, 2:] == 0) and np.all(S[:, 2:] == 0)
    eps = np.finfo(np.float64).eps
    assert 0 < np.linalg.norm(r) <= 100 * eps * np.linalg.norm(A, 2)
    e_1 = np.eye(Q.shape[1])[1]
    np.testing.assert_allclose(A @ Q, Q @ S + np.outer(r, e_1), atol=1e-14)
    ritz = np.sort(np.linalg.eigvals(np.asarray(S[:2, :2])).real)
    np.testing.assert_allclose(ritz, np.linalg.eigvalsh(np.asarray(A))[[1, 4]])
    (_, grads, t), (_, grads_ad, t_ad) = (out[a] for a in ADJOINTS)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((grads, t)))
    _assert_close((grads, t), (grads_ad, t_ad), rtol=1e-8, atol=1e-8)

    # A zero x0: every output is zero, every derivative of both rules finite (that
    # of the norm at zero too: the cotangent reaches every output).
    out = run(A, jnp.zeros(N), (A, jnp.ones(N)), cts)
    for a in ADJOINTS:
        values, grads, t = out[a]
        assert all(np.all(leaf == 0) for leaf in values), a
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((grads, t))), a

    # `A` or `x0` scaled up or down by 1e200: the scaled decomposition. The norms
    # must not square the entries unscaled (1e200 ** 2 overflows, 1e-200 ** 2
    # underflows, as 1e20 does in float32), nor may the derivatives square a norm
    # (JAX's rule for a quotient does): both rules' gradients, of a loss in
    # unscaled units, are the unscaled ones divided by the scale.
    want = run(params, x0, tangents, cts)
    for scale in (SCALE, 1 / SCALE):
        for s_A, s_x0 in ((scale, 1.0), (1.0, scale)):
            ct = tuple(_in_unscaled_units(cts, s_A, s_x0))
            got = run(s_A * params, s_x0 * x0, tangents, ct)
            values = _in_unscaled_units(got["custom_jvp"][0], s_A, s_x0)
            _assert_close(values, want["custom_jvp"][0], **_tol(jnp.float64))
            for a in ADJOINTS:
                grads = got[a][1]
                assert all(np.all(np.isfinite(g)) for g in grads), (a, scale)
                scaled = (grads[0] * s_A, grads[1] * s_x0)
                _assert_close(scaled, want[a][1], str(a), **_tol(jnp.float64))

    # A NaN in A or in x0 reaches the output: it is not taken for a breakdown and
    # masked to zero vectors.
    for A_nan, x_nan in (
        (params.at[0, 0].set(jnp.nan), x0),
        (params, x0.at[0].set(jnp.nan)),
    ):
        Q, *_, r, _ = run(A_nan, x_nan, tangents, cts)["custom_jvp"][0]
        assert np.isnan(np.asarray(Q)).any() and np.isnan(np.asarray(r)).any()


# ------------------------------------------------------------ the long basis


@method_param
def test_long_complex_basis_matches_numpy_autodiff_and_finite_differences(method):
    # A complex basis of LONG_D vectors from a dense and from a BCOO matrix: the
    # values against NumPy; the VJP with a random cotangent of both against JAX's
    # autodiff of the same scan with the dense matrix; the JVP along random
    # tangents of the dense one against finite differences (and with them the VJP)
    # and that of the BCOO one against it. One program.
    reorth = LONG_REORTH[method]
    A, _, _, x0 = _problem(method, "dense", jnp.complex128, n=LONG_N)
    p_bcoo, build_bcoo = full_operator("bcoo", A)
    rows, cols = np.asarray(build_bcoo(p_bcoo).indices).T
    fs = [
        decomposition_fn(method, LONG_D, reorthogonalize=reorth),
        decomposition_fn(method, LONG_D, build_bcoo, reorthogonalize=reorth),
        decomposition_fn(method, LONG_D, reorthogonalize=reorth, adjoint="autodiff"),
    ]
    tangents = random_like(jr.key(4), (A, x0))
    cts = random_like(jr.key(3), jax.eval_shape(fs[0], A, x0))

    @jax.jit
    def run(A, x0, p_bcoo, tangents, cts):
        t_A, t_x0 = tangents
        values_ad, vjp_ad = jax.vjp(fs[2], A, x0)
        return (
            value_vjp_jvp(fs[0], (A, x0), tangents, cts),
            value_vjp_jvp(fs[1], (p_bcoo, x0), (t_A[rows, cols], t_x0), cts),
            (values_ad, vjp_ad(cts)),
        )

    dense, bcoo, (values_ad, (g_A, g_x0)) = run(A, x0, p_bcoo, tangents, cts)
    _check_decomposition(
        method, _decomposition(method, dense[0]), A, x0, LONG_D, reorth
    )
    for got, kind in ((dense, "dense"), (bcoo, "bcoo")):
        values, grads, _ = got
        _assert_close(values, values_ad, kind, rtol=1e-12, atol=1e-12)
        g_p = g_A[rows, cols] if kind == "bcoo" else g_A
        _assert_close(grads, (g_p, g_x0), kind, rtol=1e-9, atol=1e-10)
    assert _differ(dense[1], (g_A, g_x0))
    _assert_close(bcoo[2], dense[2], rtol=1e-9, atol=1e-10)

    def derivatives(args, tangents, cts):
        return run(*args, p_bcoo, tangents, cts)[0]

    check_finite_differences(fs[0], derivatives, (A, x0))


@method_param
def test_second_derivatives_match_autodiff(method):
    # Both compositions of forward and reverse mode differentiate the hand-written
    # reverse pass itself, here with its blocks of rows: it must stay
    # differentiable in reverse mode too. Hessian-vector products in x0.
    params, _, _, x0 = decomposition_problem("dense", jnp.float64, n=LONG_N)
    A = params + params.T
    v = random_array(jr.key(10), x0.shape, x0.dtype)
    reorth = LONG_REORTH[method]

    def grad(adjoint):
        f = decomposition_fn(method, LONG_D, reorthogonalize=reorth, adjoint=adjoint)
        return jax.grad(lambda x: scalar_loss(f(A, x)))

    @jax.jit
    def hvps(x0, v):
        g = grad("custom_jvp")
        return (
            jax.grad(lambda x: jnp.vdot(g(x), v))(x0),
            jax.jvp(g, (x0,), (v,))[1],
            jax.jvp(grad("autodiff"), (x0,), (v,))[1],
        )

    rev_rev, fwd_rev, want = hvps(x0, v)
    np.testing.assert_allclose(rev_rev, want, rtol=1e-7, atol=1e-8)
    np.testing.assert_allclose(fwd_rev, want, rtol=1e-7, atol=1e-8)


@method_param
def test_numpy_cotangent_outside_jit(method):
    A, x0 = jnp.array([[1.0, 2.0], [2.0, 4.0]]), jnp.array([1.0, 1.0])
    out, vjp = jax.vjp(decomposition_fn(method, 2), A, x0)
    g_A, g_x0 = vjp(jax.tree.map(lambda y: np.ones(y.shape, y.dtype), out))
    assert g_A.shape == (2, 2) and np.all(np.isfinite(g_x0))


# ------------------------------------------------------------------ transforms

BATCH = 2


@method_param
def test_vmap_jit_and_grad_compose(method):
    A, _, _, _ = _problem(method, "dense", jnp.float64)
    xs = random_array(jr.key(6), (BATCH, N), jnp.float64)
    As = random_array(jr.key(7), (BATCH, N, N), jnp.float64)
    if method == "lanczos":
        As = (As + jnp.swapaxes(As, 1, 2)) / 2
    loss = _loss(method)

    @jax.jit
    def transformed(A, xs, As):
        decs = jax.vmap(lambda x: decompose(method, A, x, D))(xs)
        return (
            decs,
            # For Lanczos built by `matrix()` from the batched fields.
            small_matrix(decs),
            jax.grad(lambda A, xs: jnp.sum(jax.vmap(loss, (None, 0))(A, xs)), (0, 1))(
                A, xs
            ),
            jax.vmap(jax.grad(loss, (0, 1)), (None, 0))(A, xs),
            jax.grad(lambda As: jnp.sum(jax.vmap(loss, (0, None))(As, xs[0])))(As),
        )

    decs, S, grad_of_vmap, vmap_of_grad, grad_of_vmap_A = transformed(A, xs, As)
    # One by one: the values against NumPy, the gradients by one program called
    # for every element.
    for i, x in enumerate(xs):
        reference = decomposition_numpy(method, A, x, D)
        for got, want in zip(jax.tree.leaves(decs), reference, strict=True):
            np.testing.assert_allclose(got[i], want, **_tol(jnp.float64))
        if method == "arnoldi":
            np.testing.assert_allclose(S[i], reference[1], **_tol(jnp.float64))
        else:
            _, a, b, _, _ = reference
            T = np.diag(a) + np.diag(b, 1) + np.diag(b, -1)
            np.testing.assert_allclose(S[i], T, **_tol(jnp.float64))
    single_grad = jax.jit(jax.grad(loss, (0, 1)))
    grads = [single_grad(A, x) for x in xs]
    grads_A = [single_grad(B, xs[0])[0] for B in As]
    g_As = jnp.stack([g for g, _ in grads])
    g_x = jnp.stack([g for _, g in grads])
    np.testing.assert_allclose(grad_of_vmap[0], g_As.sum(0), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grad_of_vmap[1], g_x, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(vmap_of_grad[0], g_As, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(vmap_of_grad[1], g_x, rtol=1e-10, atol=1e-12)
    for g, want in zip(grad_of_vmap_A, grads_A, strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------- errors


@method_param
def test_errors_name_the_argument(method):
    A, x0 = jnp.eye(3), jnp.ones(3)
    f = unchecked(getattr(krylovjax, method))
    with pytest.raises(ValueError, match=rf"`{method}\(x0=...\)` must be one vector"):
        f(A, jnp.ones((3, 2)), 2)
    with pytest.raises(ValueError, match=rf"`{method}\(d=...\)` must be at most n = 3"):
        decompose(method, A, x0, 4)
    with pytest.raises(ValueError, match=rf"`{method}\(d=...\)` must be an int >= 1"):
        decompose(method, A, x0, 0)
    with pytest.raises(ValueError, match=rf"`{method}\(A=...\)` must be a square"):
        f(jnp.ones((3, 4)), x0, 2)
    for bad in ("yes", 1):
        with pytest.raises(
            TypeError, match=rf"`{method}\(reorthogonalize=...\)` must be"
        ):
            f(A, x0, 2, reorthogonalize=bad)
    for bad in ("custom_vjp", None):
        with pytest.raises(ValueError, match=rf"`{method}\(adjoint=...\)` must be one"):
            f(A, x0, 2, adjoint=bad)


# ---------------------------------------------------------------------- memory


@method_param
def test_reverse_pass_memory_is_linear_in_d(method):
    # Compiled from shapes only, in units of one (n, d) float64 array. The custom
    # rule keeps a few of them (A Q, the adjoint buffer, and with
    # re-orthogonalisation the first pass's rows); autodiff saves the basis buffer
    # at every step, d of them: O(n d^2), tenfold at d = 64 (shown once, for
    # Arnoldi: the measurement tells the two apart).
    n, d = 512, 64
    A = jax.ShapeDtypeStruct((n, n), jnp.float64)
    x0 = jax.ShapeDtypeStruct((n,), jnp.float64)

    def arrays(adjoint):
        f = decomposition_fn(method, d, adjoint=adjoint)
        grad = jax.grad(lambda A, x: scalar_loss(f(A, x)), (0, 1))
        return temp_bytes(grad, A, x0) / (8 * n * d)

    assert arrays("custom_jvp") <= 6
    if method == "arnoldi":
        assert arrays("autodiff") >= d


# ------------------------------------------------------- range and precision


def _values_and_gradients(method, build, cts, d):
    """`(params, x0) -> (outputs, gradients)` of `sum(cts * outputs)`, the outputs
    `[basis, S, residual, norm]`."""

    def outputs(params, x0):
        dec = decompose(method, build(params), x0, d)
        return [dec.basis, small_matrix(dec), dec.residual, dec.norm]

    def loss(params, x0):
        ys = outputs(params, x0)
        return sum(jnp.sum(c.astype(y.dtype) * y) for c, y in zip(cts, ys, strict=True))

    def run(params, x0):
        return outputs(params, x0), jax.grad(loss, (0, 1))(params, x0)

    return run


@pytest.mark.parametrize(
    "method,kind,dtype",
    # Both decompositions and both half dtypes once, with a callable (wrapped to
    # receive and return its own dtype) and a matrix (cast).
    [("arnoldi", "closure", jnp.float16), ("lanczos", "bcoo", jnp.bfloat16)],
)
def test_half_precision_computes_in_float32(method, kind, dtype):
    # In the half dtype itself, a breakdown threshold of 100 epsilons would be 0.78
    # ||A q_k|| in bfloat16, and this well-conditioned problem would stop after
    # one vector of eight.
    n = 8
    A = jnp.asarray(spd(n, seed=0, low=10.0, high=12.0), dtype)
    x0 = jnp.asarray(np.random.default_rng(1).standard_normal(n), dtype)
    params, build = full_operator(kind, A)
    shapes = [(n, n), (n, n), (n,), ()]
    cts = [
        random_array(k, s, dtype)
        for k, s in zip(jr.split(jr.key(13), 4), shapes, strict=True)
    ]
    # The gradient is that of the float32 computation (the callable applied in its
    # own dtype), rounded to the half dtype: both in one program.
    if kind == "closure":
        params32 = params

        def build32(p):
            return lambda v: build(p)(v.astype(dtype)).astype(jnp.float32)

    else:
        params32, build32 = params.astype(jnp.float32), build
    half = _values_and_gradients(method, build, cts, n)
    single = _values_and_gradients(method, build32, cts, n)
    args = (params, x0, params32, x0.astype(jnp.float32))
    # With XLA's default fusion emitters, as a user compiles it: the classic one
    # that conftest.py selects keeps the float32 reference's half-precision
    # roundings in float32 (excess precision, which XLA allows).
    (outputs, grads), (_, grads32) = (
        jax.jit(lambda p, x, p32, x32: (half(p, x), single(p32, x32)))
        .lower(*args)
        .compile({"xla_cpu_use_fusion_emitters": True})(*args)
    )
    assert all(y.dtype == dtype for y in outputs)
    Q, small, r, _ = (np.asarray(y, np.float64) for y in outputs)
    A64, x64 = np.asarray(A, np.float64), np.asarray(x0, np.float64)
    eps = float(jnp.finfo(dtype).eps)
    scale = np.linalg.norm(A64, 2)
    # All eight vectors, orthonormal and satisfying A Q = Q S + r e^T to a few
    # epsilons of the half dtype (the outputs are rounded to it).
    np.testing.assert_allclose(Q.T @ Q, np.eye(n), atol=2 * eps)
    relation = Q @ small + np.outer(r, np.eye(n)[-1])
    np.testing.assert_allclose(A64 @ Q, relation, atol=2 * eps * scale)
    if method == "arnoldi":
        reference = arnoldi_numpy(A64, x64, n)[1]
    else:
        _, alpha, beta, _, _ = lanczos_numpy(A64, x64, n)
        reference = np.diag(alpha) + np.diag(beta, 1) + np.diag(beta, -1)
    np.testing.assert_allclose(small, reference, atol=4 * eps * scale)
    for g, g32 in zip(grads, grads32, strict=True):
        assert g.dtype == dtype
        np.testing.assert_allclose(
            np.asarray(g, np.float64),
            np.asarray(g32.astype(dtype), np.float64),
            rtol=eps,
            atol=eps * float(np.max(np.abs(g32))),
        )
