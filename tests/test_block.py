"""`krylovjax.block_lanczos`, `krylovjax.block_arnoldi` and the block quadrature
built on them: values against dense references, agreement with the single-vector
methods at b = 1, deflation, derivatives (the hand-written single-vector rules,
finite differences, closed forms), transforms, operator kinds and errors.

The block methods' default derivative rule replays each step on the final basis;
it is checked against JAX's rules through the scan (`adjoint="autodiff"`), against
finite differences and a closed form, and for its compiled memory. The quadrature's
`f(T)` has a hand-written rule, checked against finite differences and against the
Daleckii-Krein gradient of log(A) written in NumPy.

Compiling is what these tests spend their time on, so every computation is jitted
and a test compiles one program with all its cases (the problems and references
are NumPy). A test that checks several things of one problem calls its program
for each: the finite-difference program of a decomposition also gives the closed
form of the trace's gradient and the derivatives at the starting blocks that
deflate. Each behaviour is tested once, on the smallest problem that shows it: one
operator kind or dtype per case rather than their product.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    check_finite_differences,
    lanczos_numpy,
    temp_bytes,
    unchecked,
    value_vjp_jvp,
)
from jax.experimental import sparse

import krylovjax
from krylovjax._block import block_trace_quadrature

METHODS = ("lanczos", "arnoldi")


# ------------------------------------------------------------------- problems


def _problem(method, n=8, b=2, seed=0, dtype=np.float64):
    """A Hermitian (Lanczos) or general (Arnoldi) `(n, n)` matrix and an `(n, b)`
    block, NumPy arrays in `dtype`."""
    rng = np.random.default_rng(seed)
    M = rng.standard_normal((n, n))
    if np.issubdtype(dtype, np.complexfloating):
        M = M + 1j * rng.standard_normal((n, n))
    A = (M + M.conj().T) / 2 if method == "lanczos" else M / np.sqrt(n)
    X = rng.standard_normal((n, b))
    if np.issubdtype(dtype, np.complexfloating):
        X = X + 1j * rng.standard_normal((n, b))
    return A.astype(dtype), X.astype(dtype)


def _spd(n=8, seed=1):
    """A symmetric positive definite matrix with eigenvalues in [0.5, 4] and its
    eigenvectors, NumPy."""
    rng = np.random.default_rng(seed)
    V, _ = np.linalg.qr(rng.standard_normal((n, n)))
    lam = np.linspace(0.5, 4.0, n)
    return (V * lam) @ V.T, V


def _numpy(tree):
    """A program's outputs as NumPy arrays: indexing and arithmetic on them in the
    checks then compile nothing."""
    return jax.tree.map(np.asarray, tree)


def _weights(seed, shapes):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s) for s in shapes)


def _decompose(method, A, X, d, **options):
    if method == "lanczos":
        dec = krylovjax.block_lanczos(A, X, d, **options)
        return dec.basis, dec.matrix(), dec.residual, dec.factor
    dec = krylovjax.block_arnoldi(A, X, d, **options)
    return dec.basis, dec.hessenberg, dec.residual, dec.factor


def _operator(kind, A):
    if kind == "dense":
        return A
    if kind == "bcoo":
        return sparse.BCOO.fromdense(A, nse=A.size)
    return lambda x: A @ x


def _numpy_funm(f, A):
    """f(A) for a Hermitian A by `numpy.linalg.eigh`."""
    lam, V = np.linalg.eigh(A)
    return (V * f(lam)) @ V.conj().T


def _check_decomposition(A, X, d, Q, H, R, R0, atol=1e-12):
    """The decomposition against NumPy: orthonormal basis, `Q^H A Q = H`, the
    Arnoldi relation, `X = Q_0 R_0` with `R_0` upper triangular, and the span of
    the block Krylov space."""
    A, X, Q, H, R, R0 = (np.asarray(y) for y in (A, X, Q, H, R, R0))
    n, b = X.shape
    m = d * b
    assert Q.shape == (n, m) and H.shape == (m, m) and R.shape == (n, b)
    np.testing.assert_allclose(Q.conj().T @ Q, np.eye(m), atol=atol)
    np.testing.assert_allclose(Q.conj().T @ A @ Q, H, atol=atol * 10)
    E = np.zeros((m, b))
    E[-b:] = np.eye(b)
    np.testing.assert_allclose(A @ Q, Q @ H + R @ E.T, atol=atol * 10)
    np.testing.assert_allclose(Q[:, :b] @ R0, X, atol=atol * 10)
    np.testing.assert_array_equal(np.tril(R0, -1), 0)
    # Gram-Schmidt's positive diagonals (R_0's and the subdiagonal blocks'),
    # which with the relations above make the decomposition unique.
    np.testing.assert_array_less(0, np.real(np.diag(R0)))
    np.testing.assert_array_less(0, np.real(np.diag(H, -b)))
    # The span is the block Krylov space's.
    K = np.concatenate([np.linalg.matrix_power(A, k) @ X for k in range(d)], axis=1)
    K, _ = np.linalg.qr(K)
    np.testing.assert_allclose(Q @ Q.conj().T, K @ K.conj().T, atol=1e-9)


def _check_structure(method, H, b):
    H = np.asarray(H)
    if method == "lanczos":
        np.testing.assert_allclose(H, H.conj().T, atol=0)
    else:
        # Block upper Hessenberg: zero below the first block subdiagonal, whose
        # blocks are upper triangular (b subdiagonals in all).
        np.testing.assert_array_equal(np.tril(H, -b - 1), 0)


# ------------------------------------------------------------------- values

# Each operator kind once, complex (the dense float64 matrix against NumPy is in
# the deflation checks, and against the single-vector methods at b = 1).
VALUE_CASES = {
    "lanczos bcoo": ("lanczos", "bcoo", np.complex128),
    "arnoldi callable": ("arnoldi", "callable", np.complex128),
}


def test_values_jit_and_vmap():
    """A complex Hermitian BCOO matrix with Lanczos and a complex callable with
    Arnoldi, under `jit` and `vmap` over three starting blocks: each block's
    decomposition against NumPy (which, with the positive diagonals, fixes it),
    T Hermitian, H block upper Hessenberg. One program."""
    d = 3
    problems = {}
    for name, (method, _, dtype) in VALUE_CASES.items():
        A, X = _problem(method, dtype=dtype)
        problems[name] = (A, np.stack([X, 2 * X[:, ::-1], X + 1]))

    @jax.jit
    def run(problems):
        out = {}
        for name, (method, kind, _) in VALUE_CASES.items():
            A, blocks = problems[name]
            f = partial(_decompose, method, _operator(kind, A), d=d)
            out[name] = jax.vmap(f)(blocks)
        return out

    out = _numpy(run(problems))
    for name, (method, _, dtype) in VALUE_CASES.items():
        A, blocks = problems[name]
        assert all(y.dtype == dtype for y in out[name]), name
        for i, X in enumerate(blocks):
            Q, H, R, R0 = (y[i] for y in out[name])
            _check_decomposition(A, X, d, Q, H, R, R0)
            _check_structure(method, H, X.shape[1])


# ------------------------------------------------ b = 1: the single-vector methods


def _fields(method, block, single):
    """The arrays of a block decomposition with b = 1 and of the single-vector one,
    in matching order."""
    if method == "lanczos":
        return (
            (
                block.basis,
                block.diagonal[:, 0, 0],
                block.off_diagonal[:, 0, 0],
                block.residual[:, 0],
                block.factor[0, 0],
            ),
            (
                single.basis,
                single.diagonal,
                single.off_diagonal,
                single.residual,
                single.norm,
            ),
        )
    return (
        (block.basis, block.hessenberg, block.residual[:, 0], block.factor[0, 0]),
        (single.basis, single.hessenberg, single.residual, single.norm),
    )


def _matrix(dec):
    return dec.matrix() if isinstance(dec, krylovjax.BlockLanczos) else dec.hessenberg


def test_block_lanczos_stays_orthonormal_in_float32_near_an_invariant_space():
    # An RBF kernel plus a small noise (400 points in the unit square,
    # lengthscale 0.2): once the large eigenvalues have converged, one
    # Gram-Schmidt pass against the basis left rounding along it as large as
    # what remained, and in float32 orthogonality was lost (0.97 here). The
    # second pass runs where the first removed most of a column; two blocks are
    # vmapped, as `trace_funm`'s are, so that they decide it together.
    n, d, b = 400, 40, 4
    rng = np.random.default_rng(0)
    points = rng.uniform(size=(n, 2))
    squared = np.sum((points[:, None] - points[None]) ** 2, axis=-1)
    A = jnp.asarray(np.exp(-squared / (2 * 0.2**2)) + 0.01 * np.eye(n), jnp.float32)
    X0 = jnp.asarray(rng.standard_normal((2, n, b)), jnp.float32)
    bases = jax.jit(jax.vmap(lambda X0: krylovjax.block_lanczos(A, X0, d).basis))(X0)
    for Q in np.asarray(bases, np.float64):
        assert np.abs(Q.T @ Q - np.eye(d * b)).max() < 1e-5


@pytest.mark.parametrize("method", METHODS)
def test_one_column_is_the_single_vector_method(method):
    """At b = 1 the block method is the single-vector one: the same arrays, with
    and without re-orthogonalisation, and the same gradient (JAX's through the
    block scan against the hand-written rules of `lanczos`/`arnoldi`; forward mode
    is checked by finite differences). One program."""
    A, X = _problem(method, b=1)
    d = 4
    block_fn = getattr(krylovjax, f"block_{method}")
    single_fn = getattr(krylovjax, method)
    Wq, Wh, Wr, W0 = _weights(5, [(8, d), (d, d), (8,), ()])

    def block(A, X, **options):
        dec = block_fn(A, X, d, **options)
        loss = (
            jnp.sum(Wq * jnp.sin(dec.basis))
            + jnp.sum(Wh * _matrix(dec))
            + jnp.sum(Wr * dec.residual[:, 0])
            + W0 * dec.factor[0, 0]
        )
        return loss, dec

    def single(A, x, **options):
        dec = single_fn(A, x, d, **options)
        H = dec.matrix() if method == "lanczos" else dec.hessenberg
        loss = (
            jnp.sum(Wq * jnp.sin(dec.basis))
            + jnp.sum(Wh * H)
            + jnp.sum(Wr * dec.residual)
            + W0 * dec.norm
        )
        return loss, dec

    @jax.jit
    def run(A, X):
        out = {}
        for name, fn, x in (("block", block, X), ("single", single, X[:, 0])):
            (value, dec), grads = jax.value_and_grad(fn, (0, 1), has_aux=True)(A, x)
            out[name] = (value, grads, dec)
        out["twice"] = _fields(method, out["block"][2], out["single"][2])
        once = {"reorthogonalize": False}
        out["once"] = _fields(
            method, block(A, X, **once)[1], single(A, X[:, 0], **once)[1]
        )
        return out

    out = _numpy(run(A, X))
    v_block, g_block, _ = out["block"]
    v_single, g_single, _ = out["single"]
    for block_arrays, single_arrays in (out["twice"], out["once"]):
        *rest_b, factor = block_arrays
        *rest_s, norm = single_arrays
        for got, want in zip(rest_b, rest_s, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-12)
        np.testing.assert_allclose(factor, norm, rtol=1e-14)
    np.testing.assert_allclose(v_block, v_single, rtol=1e-12)
    np.testing.assert_allclose(g_block[0], g_single[0], atol=1e-10)
    np.testing.assert_allclose(g_block[1][:, 0], g_single[1], atol=1e-10)


# ------------------------------------------- finite differences and deflation


def _deflated_blocks(V, d):
    """Starting blocks of three columns that deflate, and the columns of Q (of d
    blocks) that must be zero."""
    rng = np.random.default_rng(2)
    n = V.shape[0]
    x, y = rng.standard_normal(n), rng.standard_normal(n)
    return {
        # A repeated column: column 1 of every block is zero.
        "repeated": (np.stack([x, x, y], axis=1), [1 + 3 * k for k in range(d)]),
        "zero": (np.stack([x, np.zeros(n), y], axis=1), [1 + 3 * k for k in range(d)]),
        # Columns spanning an invariant subspace: every later block is zero.
        "invariant": (V[:, :3] @ rng.standard_normal((3, 3)), list(range(3, 3 * d))),
    }


def _all_finite(tree):
    return all(np.all(np.isfinite(x)) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("method", METHODS)
def test_finite_differences_deflation_and_trace_gradient(method):
    """Every output at d b = n against finite differences in float64, forward and
    reverse (`helpers.check_finite_differences`), and a closed form from the same
    program: T (or H) is similar to A, so tr T = tr A, whose gradient is the
    identity in A and zero in X. Then the same program at starting blocks that
    deflate (a repeated column, a zero column, columns spanning an invariant
    subspace): zero columns of Q where they deflate, the rest orthonormal,
    `Q^T A Q = H`, `X = Q_0 R_0`, no residual for the invariant subspace, and
    finite derivatives in both modes."""
    d = 3
    A, X = _problem(method, n=9, b=3)
    f = partial(_decompose, method, d=d)
    derivatives = jax.jit(partial(value_vjp_jvp, f))
    check_finite_differences(f, derivatives, (jnp.asarray(A), jnp.asarray(X)), eps=1e-6)
    # The cotangent of tr H.
    trace = (np.zeros((9, 9)), np.eye(9), np.zeros((9, 3)), np.zeros((3, 3)))
    out, (g_A, g_X), _ = _numpy(derivatives((A, X), (A, X), trace))
    np.testing.assert_allclose(np.trace(out[1]), np.trace(A), rtol=1e-12)
    np.testing.assert_allclose(g_A, np.eye(9), atol=1e-10)
    np.testing.assert_allclose(g_X, 0, atol=1e-10)
    S, V = _spd(n=9)
    cotangents = _weights(7, [(9, 3 * d), (3 * d, 3 * d), (9, 3), (3, 3)])
    for case, (X, zero) in _deflated_blocks(V, d).items():
        out, grads, tangents = _numpy(derivatives((S, X), (S, X), cotangents))
        Q, H, R, R0 = out
        assert _all_finite(out), case
        assert _all_finite(grads) and _all_finite(tangents), case
        np.testing.assert_array_equal(Q[:, zero], 0)
        kept = [j for j in range(Q.shape[1]) if j not in zero]
        np.testing.assert_allclose(
            Q[:, kept].T @ Q[:, kept], np.eye(len(kept)), atol=1e-12
        )
        np.testing.assert_allclose(Q.T @ S @ Q, H, atol=1e-12)
        np.testing.assert_allclose(Q[:, :3] @ R0, X, atol=1e-12)
        if case == "invariant":
            # The basis spans the invariant subspace exactly: no residual.
            np.testing.assert_allclose(R, 0, atol=1e-12)


def test_rule_against_autodiff_under_vmap():
    """The default rule (`adjoint="custom_jvp"`, which replays each step on the
    final basis) against JAX's rules through the same scan (`"autodiff"`):
    values, a VJP and a JVP of every output, float64, for Lanczos with
    re-orthogonalisation and Arnoldi without, for two starting blocks under
    `jax.vmap` (one with a repeated column, which deflates), in one program."""
    d, n = 3, 9
    rng = np.random.default_rng(3)
    x, y, z = rng.standard_normal((3, n))
    blocks = np.stack([np.stack([x, y, z], 1), np.stack([x, x, y], 1)])
    # Both methods, and both ways of orthonormalising a block's columns.
    cases = [("lanczos", True), ("arnoldi", False)]

    @jax.jit
    def run(A, S, blocks, t_A, t_S, t_X, cts):
        out = {}
        for method, reorth in cases:
            M, t_M = (S, t_S) if method == "lanczos" else (A, t_A)
            for adjoint in ("custom_jvp", "autodiff"):

                def f(M, X, method=method, reorth=reorth, adjoint=adjoint):
                    options = {"reorthogonalize": reorth, "adjoint": adjoint}
                    one = partial(_decompose, method, M, d=d, **options)
                    return jax.vmap(one)(X)

                args = ((M, blocks), (t_M, t_X), cts)
                out[method, reorth, adjoint] = value_vjp_jvp(f, *args)
        return out

    A, _ = _problem("arnoldi", n=n)
    S, _ = _spd(n=n)
    t_A, t_S = _weights(4, [(n, n), (n, n)])
    t_X = _weights(5, [blocks.shape])[0]
    m = 3 * d
    cts = _weights(6, [(2, n, m), (2, m, m), (2, n, 3), (2, 3, 3)])
    out = _numpy(run(A, S, blocks, t_A, t_S + t_S.T, t_X, cts))
    for method, reorth in cases:
        ours, reference = (
            out[method, reorth, "custom_jvp"],
            out[method, reorth, "autodiff"],
        )
        pairs = zip(jax.tree.leaves(ours), jax.tree.leaves(reference), strict=True)
        for got, want in pairs:
            np.testing.assert_allclose(
                got, want, atol=1e-10, err_msg=str((method, reorth))
            )


def test_rule_memory_grows_linearly_in_d():
    """Compiled memory of the gradient of block Lanczos (n = 512, b = 4, float32):
    the default rule keeps a few blocks per step, so doubling d at most doubles
    it (the basis does), and at d = 32 it is under a quarter of what JAX's rules
    through the scan (`adjoint="autodiff"`) keep, the basis at every step."""
    n, b = 512, 4
    A = jax.ShapeDtypeStruct((n, n), jnp.float32)
    X = jax.ShapeDtypeStruct((n, b), jnp.float32)

    def grad(d, adjoint):
        def loss(A, X):
            dec = krylovjax.block_lanczos(A, X, d, adjoint=adjoint)
            return jnp.sum(dec.residual**2) + jnp.sum(dec.diagonal)

        return temp_bytes(jax.grad(loss, (0, 1)), A, X)

    rule = {d: grad(d, "custom_jvp") for d in (16, 32)}
    assert rule[32] <= 2 * rule[16]
    assert rule[32] < grad(32, "autodiff") / 4


def _log_gradient(A, G):
    """The gradient in A of <G, log(A)> for a symmetric positive definite A, along
    symmetric directions, by the Daleckii-Krein formula in NumPy:
    V (F * V^T sym(G) V) V^T with F the divided differences of log."""
    lam, V = np.linalg.eigh(A)
    dl, dlog = lam[:, None] - lam[None, :], np.log(lam)[:, None] - np.log(lam)
    same = np.abs(dl) < 1e-9
    F = np.where(same, 1 / lam[:, None], dlog / np.where(same, 1.0, dl))
    return V @ (F * (V.T @ ((G + G.T) / 2) @ V)) @ V.T


def test_quadrature():
    """`funm_action` of a block (method="lanczos", of a callable) and
    `block_trace_quadrature` (of a BCOO matrix) at d b = n of log(x + t), an f that
    closes over a parameter t, in one program: against finite differences in float64
    in A, B and t, forward and reverse; at t = 0 the closed forms log(A) B and
    tr(B^T log(A) B), with the gradient of <W, log(A) B> (Daleckii-Krein in NumPy;
    the decomposition differentiates every entry of A, so along symmetric
    directions). Then at t = 0 (the logarithm) and starting blocks that deflate,
    whose unseen eigenvalues log would make infinite: finite values and derivatives,
    equal columns for the repeated column, a zero column for the zero one, and exact
    for the invariant subspace, with the derivative in A of Q_0 log(Q_0^T A Q_0) R_0
    for the fixed Q_0 R_0 = X (deflated blocks have zero tangents)."""
    d = 3
    S, V = _spd(n=9)
    B = _problem("lanczos", n=9, b=3, seed=4)[1]

    def f(A, B, t):
        return (
            krylovjax.funm_action(
                lambda x: jnp.log(x + t),
                _operator("callable", A),
                B,
                d,
                method="lanczos",
            ),
            block_trace_quadrature(
                lambda x: jnp.log(x + t), _operator("bcoo", A), B, d
            ),
        )

    derivatives = jax.jit(partial(value_vjp_jvp, f))
    args = (jnp.asarray(S), jnp.asarray(B), jnp.asarray(0.7, jnp.float64))
    check_finite_differences(f, derivatives, args, eps=1e-6)

    log_S = _numpy_funm(np.log, S)
    zero, one = np.float64(0.0), np.float64(1.0)
    (C,) = _weights(8, [(9, 3)])
    (action, trace), (g_A, g_B, _), _ = _numpy(
        derivatives((S, B, zero), (S, B, one), (C, zero))
    )
    np.testing.assert_allclose(action, log_S @ B, atol=1e-12)
    np.testing.assert_allclose(trace, np.trace(B.T @ log_S @ B), rtol=1e-12)
    np.testing.assert_allclose(g_B, log_S @ C, atol=1e-10)
    w_A = _log_gradient(S, C @ B.T)
    np.testing.assert_allclose((g_A + g_A.T) / 2, w_A, atol=1e-10)

    for case, (X, _) in _deflated_blocks(V, d).items():
        out, grads, tangents = _numpy(derivatives((S, X, zero), (S, X, one), (C, one)))
        assert _all_finite(out), case
        assert _all_finite(grads) and _all_finite(tangents), case
        values = out[0]
        if case == "invariant":
            # The Krylov space is invariant: exact.
            np.testing.assert_allclose(values, log_S @ X, atol=1e-12)
            np.testing.assert_allclose(out[1], np.trace(X.T @ log_S @ X), rtol=1e-12)
            # The gradient of <C, action> alone: the same program, cotangent (C, 0).
            _, (g_A, _, _), _ = _numpy(
                derivatives((S, X, zero), (S, X, one), (C, zero))
            )
            Q0, R0 = np.linalg.qr(X)
            w_A = Q0 @ _log_gradient(Q0.T @ S @ Q0, Q0.T @ C @ R0.T) @ Q0.T
            np.testing.assert_allclose(g_A, w_A, atol=1e-10)
        if case == "repeated":
            np.testing.assert_allclose(values[:, 0], values[:, 1], atol=1e-12)
        if case == "zero":
            np.testing.assert_array_equal(values[:, 1], 0)


def test_trace_quadrature_exactness():
    """Block Gauss quadrature of depth d is exact for degrees up to 2 d - 1, and at
    b = 1 it is the single-vector Lanczos quadrature (`helpers.lanczos_numpy`). One
    program."""
    S, _ = _spd(n=9)
    B = _problem("lanczos", n=9, b=3, seed=4)[1]

    @jax.jit
    def run(A, B):
        return (
            block_trace_quadrature(lambda x: x**3, A, B, 2),
            block_trace_quadrature(jnp.log, A, B[:, :1], 3),
        )

    cube, one = _numpy(run(S, B))
    cubed = np.trace(B.T @ np.linalg.matrix_power(S, 3) @ B)
    np.testing.assert_allclose(cube, cubed, rtol=1e-12)
    _, alpha, beta, _, norm = lanczos_numpy(S, B[:, 0], 3)
    lam, V = np.linalg.eigh(np.diag(alpha) + np.diag(beta, 1) + np.diag(beta, -1))
    single = norm**2 * np.sum(V[0] ** 2 * np.log(lam))
    np.testing.assert_allclose(one, single, rtol=1e-12)


def test_lanczos_action_of_a_tiny_or_huge_block():
    """`f(A) B` is linear in `B`: at entries of 1e-20 and 1e20 in float32 (whose
    sums of squares under- and overflow) the block Lanczos action, and its
    gradient in `A`, are those of the unit block, scaled. Both were wrong: every
    eigenvalue of T was taken as unseen by the block."""
    A = jnp.diag(jnp.arange(1.0, 5.0, dtype=jnp.float32))
    B = jnp.asarray([[1, 0], [0, 1], [1, 0], [0, 1]], jnp.float32)

    @jax.jit
    def run(A):
        def y(A, s):
            b = jnp.asarray(s, jnp.float32) * B
            return krylovjax.funm_action(jnp.log, A, b, 2, method="lanczos") / s

        grad = jax.grad(lambda A, s: jnp.sum(y(A, s)))
        return [(y(A, s), grad(A, s)) for s in (1.0, 1e-20, 1e20)]

    (want, want_grad), *scaled = run(A)
    np.testing.assert_allclose(
        want, np.log(np.arange(1.0, 5.0))[:, None] * np.asarray(B), atol=1e-6
    )
    for value, grad in scaled:
        np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)


def test_arnoldi_action():
    """`funm_action` of a block with method="arnoldi": f(H) E_0 R_0 for a matrix
    function f. At d b = n the closed form (A + t I)^{-1} B for `inv` of H + t I,
    an f that closes over t; finite differences in float64 in A, B and t, forward
    and reverse; the gradient of <W, (A + t I)^{-1} B> in A, -M^{-T} W B^T M^{-T}
    with M = A + t I. Then the deflating blocks: `inv` at the zero rows and columns
    of a deflated column would be infinite, and a zero block gives zeros, all with
    finite derivatives; the repeated column gives equal columns."""
    d = 3
    A, B = _problem("arnoldi", n=9, b=3, seed=5)
    _, V = _spd(n=9)

    def f(A, B, t):
        def inv(H):
            return jnp.linalg.inv(H + t * jnp.eye(H.shape[0], dtype=H.dtype))

        return krylovjax.funm_action(inv, A, B, d, method="arnoldi")

    derivatives = jax.jit(partial(value_vjp_jvp, f))
    t = np.float64(2.0)
    args = (jnp.asarray(A), jnp.asarray(B), jnp.asarray(t))
    check_finite_differences(f, derivatives, args, eps=1e-6)

    (W,) = _weights(9, [(9, 3)])
    M_inv = np.linalg.inv(A + t * np.eye(9))
    value, (g_A, g_B, g_t), _ = _numpy(
        derivatives((A, B, t), (A, B, t), jnp.asarray(W))
    )
    np.testing.assert_allclose(value, M_inv @ B, atol=1e-12)
    np.testing.assert_allclose(g_A, -M_inv.T @ W @ B.T @ M_inv.T, atol=1e-10)
    np.testing.assert_allclose(g_B, M_inv.T @ W, atol=1e-10)
    np.testing.assert_allclose(g_t, -np.sum(W * (M_inv @ M_inv @ B)), rtol=1e-10)

    cases = _deflated_blocks(V, d) | {"all zero": (np.zeros((9, 3)), [])}
    for case, (X, _) in cases.items():
        out = _numpy(derivatives((A, X, 0.0 * t), (A, X, t), jnp.asarray(W)))
        assert _all_finite(out), case
        if case == "repeated":
            np.testing.assert_allclose(out[0][:, 0], out[0][:, 1], atol=1e-12)
        if case in ("zero", "all zero"):
            np.testing.assert_array_equal(out[0][:, 1], 0)


def test_block_chebyshev_action_is_per_column():
    """A block with method="chebyshev" is the single-vector action of each column."""
    S, _ = _spd(n=9)
    B = _problem("lanczos", n=9, b=2, seed=4)[1]

    @jax.jit
    def run(S, B):
        def one(b):
            return krylovjax.funm_action(
                jnp.exp, S, b, 6, method="chebyshev", interval=(0.4, 4.1)
            )

        return one(B), jnp.stack([one(B[:, 0]), one(B[:, 1])], axis=1)

    block, columns = _numpy(run(S, B))
    np.testing.assert_allclose(block, columns, rtol=1e-13, atol=1e-13)


def test_trace_funm_block_size():
    """`trace_funm(block_size=b)`: at b = 1 the single-vector estimate, value and
    gradient; at d b = n each block's quadrature is exact, so the estimate is the
    mean of z^T log(A) z over the probes and its gradient the Daleckii-Krein
    gradient of log(A) with G = Z^T Z / m (`_log_gradient`); finite differences in
    float64 of the estimate (at d b < n) and its standard error over the blocks.
    One program."""
    S, _ = _spd(n=8)
    key = jax.random.key(3)

    def estimate(S, d, b):
        return krylovjax.trace_funm(
            jnp.log, S, key, d, num_probes=8, block_size=b, return_info=True
        )

    @jax.jit
    def run(S):
        def value_and_grad(d, b):
            return jax.value_and_grad(lambda S: estimate(S, d, b)[0])(S)

        return (
            value_and_grad(3, 1),
            jax.value_and_grad(
                lambda S: krylovjax.trace_funm(jnp.log, S, key, 3, num_probes=8)
            )(S),
            value_and_grad(2, 4),
            estimate(S, 2, 4)[1].standard_error,
        )

    one, single, (exact, g_exact), error = _numpy(run(S))
    np.testing.assert_allclose(one[0], single[0], rtol=1e-13)
    np.testing.assert_allclose(one[1], single[1], rtol=1e-12, atol=1e-13)
    Z = np.asarray(jax.random.rademacher(key, (8, 8), jnp.float64))
    log_S = _numpy_funm(np.log, S)
    terms = [np.trace(Z[i : i + 4] @ log_S @ Z[i : i + 4].T) / 4 for i in (0, 4)]
    np.testing.assert_allclose(exact, np.mean(terms), rtol=1e-12)
    np.testing.assert_allclose(error, np.std(terms, ddof=1) / np.sqrt(2), rtol=1e-10)
    w = _log_gradient(S, Z.T @ Z / 8)
    np.testing.assert_allclose((g_exact + g_exact.T) / 2, w, atol=1e-10)

    def f(S):
        return estimate(S, 1, 4)[0]

    derivatives = jax.jit(partial(value_vjp_jvp, f))
    check_finite_differences(f, derivatives, (jnp.asarray(S),), eps=1e-6)


def test_trace_funm_block_size_of_a_complex_function():
    """A complex `f` (`log` of an indefinite A) with blocks keeps its imaginary
    part, as without blocks: the estimate of `log` is that of its real part plus
    i times that of its imaginary part, from the same probes. The block path
    dropped the imaginary part."""
    A = jnp.asarray(_spd()[0] - 1.5 * np.eye(8))  # eigenvalues from -1 to 2.5

    def clog(x):
        return jnp.log(x.astype(jnp.complex128))

    @jax.jit
    def run(A):
        return [
            krylovjax.trace_funm(f, A, jax.random.key(0), 2, num_probes=4, block_size=2)
            for f in (clog, lambda x: jnp.real(clog(x)), lambda x: jnp.imag(clog(x)))
        ]

    value, real, imag = (np.asarray(v) for v in run(A))
    assert value.dtype == jnp.complex128 and abs(float(imag)) > 0.1
    np.testing.assert_allclose(value, real + 1j * imag, rtol=1e-12)


def test_trace_funm_block_size_errors():
    S, key = np.eye(4), jax.random.key(0)
    cases = [
        ({"num_probes": 6, "block_size": 4}, r"must divide `num_probes` = 6"),
        ({"num_probes": 4, "block_size": 4, "d": 2}, r"times `d` must be at most n"),
        (
            {"num_probes": 6, "block_size": 2, "estimator": "hutch++"},
            r"is taken by `estimator='hutchinson'`",
        ),
        ({"num_probes": 4, "block_size": 2, "tol": 1e-3}, r"and `tol=\.\.\.`"),
    ]
    for options, match in cases:
        options = {"d": 1} | options
        d = options.pop("d")
        with pytest.raises(ValueError, match=r"`trace_funm\(block_size=\.\.\.\)`"):
            krylovjax.trace_funm(jnp.log, S, key, d, **options)
        with pytest.raises(ValueError, match=match):
            krylovjax.trace_funm(jnp.log, S, key, d, **options)


# ------------------------------------------------------------------ errors


# (args, options, error, match, outside): `outside` when the arguments lie outside
# the annotations, which the runtime checker rejects first (`helpers.unchecked`).
ERRORS = [
    (
        (np.eye(4), np.ones(4), 1),
        {},
        ValueError,
        r"`block_lanczos\(X0=\.\.\.\)` must have shape \(n, b\); got shape \(4,\)",
        True,
    ),
    (
        (np.eye(4), np.ones((4, 3)), 2),
        {},
        ValueError,
        r"`block_lanczos\(d=\.\.\.\)` must satisfy d b <= n = 4",
        False,
    ),
    ((np.eye(4), np.ones((4, 1)), 0), {}, ValueError, r"`block_lanczos\(d=", False),
    ((np.eye(4), np.ones((4, 1)), 2.0), {}, TypeError, r"`block_lanczos\(d=", True),
    (
        (np.eye(3), np.ones((4, 1)), 1),
        {},
        ValueError,
        r"`block_lanczos\(X0=\.\.\.\)` must have first axis of length 3",
        True,
    ),
    (
        (np.eye(3), np.ones((4, 2)), 1),
        {},
        ValueError,
        r"`block_lanczos\(X0=\.\.\.\)` must have first axis of length 3 to match "
        r"`A` of shape \(3, 3\); got shape \(4, 2\)\.",
        True,
    ),
    (
        (lambda v: v[:3], np.ones((4, 2)), 1),
        {},
        ValueError,
        r"`block_lanczos\(A=\.\.\.\)` must be a callable that returns an array of the "
        r"same shape as a column of `X0`, \(4,\); it returned shape \(3,\)\.",
        True,
    ),
    ((np.eye(4), np.ones((4, 1), int), 1), {}, TypeError, r"`block_lanczos\(X0", True),
    (
        (np.eye(4), np.ones((4, 1)), 1),
        {"adjoint": "custom_vjp"},
        ValueError,
        r"`block_lanczos\(adjoint=\.\.\.\)` must be one of 'custom_jvp', 'autodiff'",
        True,
    ),
    (
        (np.eye(4), np.ones((4, 1)), 1),
        {"reorthogonalize": 1},
        TypeError,
        r"`block_lanczos\(reorthogonalize=\.\.\.\)` must be a bool",
        True,
    ),
]


@pytest.mark.parametrize(("args", "options", "error", "match", "outside"), ERRORS)
def test_errors(args, options, error, match, outside):
    fn = unchecked(krylovjax.block_lanczos) if outside else krylovjax.block_lanczos
    with pytest.raises(error, match=match):
        fn(*args, **options)


def test_errors_arnoldi_and_quadrature():
    with pytest.raises(ValueError, match=r"`block_arnoldi\(X0=\.\.\.\)` must have"):
        unchecked(krylovjax.block_arnoldi)(np.eye(4), np.ones((2, 2, 2)), 1)
    with pytest.raises(TypeError, match=r"`funm_action\(f=\.\.\.\)` must be a"):
        unchecked(krylovjax.funm_action)(
            3.0, np.eye(4), np.ones((4, 1)), 1, method="arnoldi"
        )
    with pytest.raises(ValueError, match=r"`funm_action\(b=\.\.\.\)` must be a vector"):
        unchecked(krylovjax.funm_action)(
            jnp.log, np.eye(4), np.ones((4, 1, 1)), 1, method="lanczos"
        )
    with pytest.raises(ValueError, match=r"`funm_action\(tol=\.\.\.\)` takes one"):
        krylovjax.funm_action(
            jnp.log, np.eye(4), np.ones((4, 2)), 1, method="lanczos", tol=1e-3
        )
    with pytest.raises(ValueError, match=r"`funm_action\(f=\.\.\.\)` must map the"):
        krylovjax.funm_action(
            lambda H: H[0], np.eye(4), np.ones((4, 2)), 2, method="arnoldi"
        )
    with pytest.raises(ValueError, match=r"`block_trace_quadrature\(Z=\.\.\.\)`"):
        unchecked(block_trace_quadrature)(jnp.log, np.eye(4), np.ones(4), 1)
