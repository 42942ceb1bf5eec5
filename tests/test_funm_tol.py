"""`funm_action(tol=...)`: the depth it picks against a sweep of depths, its true
error, the report, derivatives (exact for the approximation returned) against
three oracles, `vmap`, breakdown and argument errors.

The sweep is the error at every depth from one decomposition of the maximum depth
(the approximation from $k$ vectors uses its leading $k$ columns and the leading
block of the small matrix), against SciPy's `expm` and NumPy's `eigh`.
"""

from functools import partial

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.scipy.linalg
import numpy as np
import pytest
import scipy.linalg
from helpers import (
    check_finite_differences,
    full_operator,
    random_like,
    unchecked,
    value_vjp_jvp,
)

import krylovjax

expm = jax.scipy.linalg.expm


def path_laplacian(n):
    main = np.full(n, 2.0)
    main[[0, -1]] = 1.0
    return np.diag(main) - np.diag(np.ones(n - 1), 1) - np.diag(np.ones(n - 1), -1)


def spd_kernel(n, seed=0):
    """An RBF kernel matrix plus noise: condition number about 10^3."""
    x = np.random.default_rng(seed).uniform(size=n)
    K = np.exp(-((x[:, None] - x[None]) ** 2) / (2 * 0.3**2))
    return K + 1e-3 * np.eye(n)


def lanczos_sweep(A, b, d, f):
    """The Lanczos approximations of f(A) b from 1 .. d vectors."""
    dec = krylovjax.lanczos(jnp.asarray(A), jnp.asarray(b), d)
    Q, T = np.asarray(dec.basis), np.asarray(dec.matrix())
    ys = []
    for k in range(1, d + 1):
        lam, V = np.linalg.eigh(T[:k, :k])
        with np.errstate(all="ignore"):  # f at the zero block after a breakdown
            ys.append(float(dec.norm) * Q[:, :k] @ (V @ (f(lam) * V[0])))
    return ys


def arnoldi_sweep(A, b, d, t):
    dec = krylovjax.arnoldi(jnp.asarray(A), jnp.asarray(b), d)
    Q, H = np.asarray(dec.basis), np.asarray(dec.hessenberg)
    return [
        float(dec.norm) * Q[:, :k] @ scipy.linalg.expm(-t * H[:k, :k])[:, 0]
        for k in range(1, d + 1)
    ]


def relative(y, exact):
    return np.linalg.norm(np.asarray(y) - exact) / np.linalg.norm(exact)


def test_depth_against_a_sweep_and_the_true_error():
    """Superlinear convergence ($e^{-tL} b$, Lanczos and Arnoldi) and linear
    convergence ($K^{-1/2} b$, condition number about $10^3$): the depth used is
    the smallest whose true error is below `tol`, or a few steps more (the stop
    test runs every step up to 16, then every `k // 16`), the true error is below
    `tol`, the report says so, and the result is the fixed-depth approximation of
    that depth."""
    n, t = 60, 3.0
    L, K = path_laplacian(n), spd_kernel(n)
    b = np.random.default_rng(1).normal(size=n)
    w, V = np.linalg.eigh(K)
    # The maximum depths: above the depths used (17 and 11), and small, since the
    # stop test holds one copy of `f` per size in `block_sizes(d)` (8, 16, d).
    cases = {
        "exp lanczos": (L, scipy.linalg.expm(-t * L) @ b, 24),
        "exp arnoldi": (L, scipy.linalg.expm(-t * L) @ b, 24),
        "inverse sqrt": (K, V @ (w**-0.5 * (V.T @ b)), 16),
    }
    sweeps = {
        "exp lanczos": lanczos_sweep(L, b, 24, lambda x: np.exp(-t * x)),
        "exp arnoldi": arnoldi_sweep(L, b, 24, t),
        "inverse sqrt": lanczos_sweep(K, b, 16, lambda x: x**-0.5),
    }
    functions = {
        "exp lanczos": (lambda x: jnp.exp(-t * x), "lanczos"),
        "exp arnoldi": (lambda H: expm(-t * H), "arnoldi"),
        "inverse sqrt": (lambda x: x**-0.5, "lanczos"),
    }
    tols = (1e-8,)

    @jax.jit
    def run(L, K, b):
        out = {}
        for name, (f, method) in functions.items():
            A = K if name == "inverse sqrt" else L
            d = cases[name][2]
            for tol in tols:
                out[name, tol] = krylovjax.funm_action(
                    f, A, b, d, method=method, tol=tol
                )
        return out

    out = run(jnp.asarray(L), jnp.asarray(K), jnp.asarray(b))
    for (name, tol), (y, info) in out.items():
        exact = cases[name][1]
        errors = [relative(y_k, exact) for y_k in sweeps[name]]
        smallest = 1 + next(k for k, e in enumerate(errors) if e < tol)
        depth = int(info.depth)
        assert smallest <= depth <= smallest + max(2, smallest // 8), (name, tol)
        assert relative(y, exact) < tol, (name, tol)
        assert bool(info.converged)
        assert 0 < float(info.error) <= tol * np.linalg.norm(np.asarray(y))
        # The estimate is not far above the truth (for these problems).
        assert float(info.error) < 100 * np.linalg.norm(np.asarray(y) - exact)
        np.testing.assert_allclose(y, sweeps[name][depth - 1], rtol=1e-10, atol=1e-14)


def test_maximum_depth_reached_and_breakdown():
    """A depth too small for `tol`: all of it is used and the report says it did
    not converge. A `b` in an invariant space of dimension 3: three vectors, an
    exact result and an error of zero."""
    n = 20
    A = np.diag(np.linspace(1.0, 5.0, n))
    b = np.random.default_rng(0).normal(size=n)
    b_inv = np.zeros(n)
    b_inv[[0, 7, 12]] = 1.0

    @jax.jit
    def run(A, b, b_inv):
        short = krylovjax.funm_action(jnp.log, A, b, 4, method="lanczos", tol=1e-12)
        fixed = krylovjax.funm_action(jnp.log, A, b, 4, method="lanczos")
        # At most 8 vectors: the stop test holds one copy of `f` (`block_sizes`).
        broken = krylovjax.funm_action(jnp.log, A, b_inv, 8, method="lanczos", tol=1e-8)
        arnoldi = krylovjax.funm_action(
            jax.scipy.linalg.expm, A, b_inv, 8, method="arnoldi", tol=1e-8
        )
        return short, fixed, broken, arnoldi

    (y, info), fixed, (y_inv, info_inv), (z_inv, info_z) = run(
        jnp.asarray(A), jnp.asarray(b), jnp.asarray(b_inv)
    )
    assert int(info.depth) == 4 and not bool(info.converged)
    assert float(info.error) > 1e-12 * np.linalg.norm(np.asarray(y))
    np.testing.assert_array_equal(y, fixed)
    for got, report, fn in ((y_inv, info_inv, np.log), (z_inv, info_z, np.exp)):
        assert int(report.depth) == 3 and bool(report.converged)
        assert float(report.error) == 0
        np.testing.assert_allclose(got, fn(np.diag(A)) * b_inv, rtol=1e-12, atol=1e-15)


def test_large_values_in_float32():
    """`exp` of eigenvalues from 30 to 50 in float32: values up to 5e21, whose
    squares overflow. The depth chosen meets the tolerance (true error below it)
    with a finite error estimate. Before, the norm of the coefficients was
    infinite and every tolerance was met at the first check (depth 2, error 93%)."""
    n, tol = 40, 1e-5
    lam = np.linspace(30.0, 50.0, n)
    b = np.random.default_rng(0).normal(size=n)
    A32, b32 = jnp.diag(jnp.asarray(lam, jnp.float32)), jnp.asarray(b, jnp.float32)
    y, info = jax.jit(
        lambda A, b: krylovjax.funm_action(jnp.exp, A, b, 30, method="lanczos", tol=tol)
    )(A32, b32)
    want = np.exp(lam) * b
    error = np.linalg.norm(np.asarray(y, np.float64) - want) / np.linalg.norm(want)
    assert error < tol and bool(info.converged), (error, info)
    assert np.isfinite(float(info.error)) and 2 < int(info.depth) < 30, info


def resolvent(shift, H):
    """(shift I - H)^{-1}: a matrix function cheaper to compile than `expm`."""
    eye = jnp.eye(H.shape[0], dtype=H.dtype)
    return jnp.linalg.solve(shift.astype(H.dtype) * eye - H, eye)


def test_derivatives_are_those_of_the_approximation_returned():
    """With respect to a BCOO matrix's values, `b`, and a time `f` closes over
    (Lanczos: exp(-t x); Arnoldi: the resolvent at -3 - t), and a callable's arrays
    (Arnoldi): the default rules against JAX's own rules through the same
    early-stopped scan, against the derivatives of the fixed-depth call at the
    depth used, and against finite differences in forward and reverse mode. The
    default rules, autodiff and the depths used in one program, the fixed depths
    in a second."""
    n, d = 14, 14
    L = path_laplacian(n)
    p_bcoo, build_bcoo = full_operator("bcoo", L)
    p_closure, build_closure = full_operator("closure", L + np.triu(L, 1) / 4)
    b = jnp.asarray(np.random.default_rng(2).normal(size=n))
    t = jnp.asarray(0.7, jnp.float64)
    tol = 1e-7

    def call(adjoint, depths=None, report=False):
        def f(p_bcoo, p_closure, b, t):
            kw = {"adjoint": adjoint}
            if depths is None:
                kw["tol"] = tol
            lanczos = krylovjax.funm_action(
                lambda x: jnp.exp(-t * x),
                build_bcoo(p_bcoo),
                b,
                d if depths is None else depths[0],
                method="lanczos",
                **kw,
            )
            arnoldi = krylovjax.funm_action(
                lambda H: resolvent(-3 - t, H),
                build_closure(p_closure),
                b,
                d if depths is None else depths[1],
                method="arnoldi",
                **kw,
            )
            if depths is not None:
                return lanczos, arnoldi
            values = (lanczos[0], arnoldi[0])
            # The depths used, beside the values (not differentiated).
            return (values, (lanczos[1].depth, arnoldi[1].depth)) if report else values

        return f

    args = (p_bcoo, p_closure, b, t)
    tangents = random_like(jr.key(3), args)
    cts = random_like(jr.key(4), jax.eval_shape(call("custom_jvp"), *args))

    @jax.jit
    def run(args, tangents, cts):
        out, linear, used = jax.linearize(
            call("custom_jvp", report=True), *args, has_aux=True
        )
        custom = (out, jax.linear_transpose(linear, *args)(cts), linear(*tangents))
        autodiff = value_vjp_jvp(call("autodiff"), args, tangents, cts)
        return custom, autodiff, used

    custom, autodiff, used = run(args, tangents, cts)
    depths = tuple(int(k) for k in used)
    assert all(k < d for k in depths), depths
    fixed = jax.jit(partial(value_vjp_jvp, call("custom_jvp", depths)))(
        args, tangents, cts
    )
    for other in (autodiff, fixed):
        for got, want in zip(
            jax.tree.leaves(custom), jax.tree.leaves(other), strict=True
        ):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    check_finite_differences(
        call("custom_jvp"), lambda *a: run(*a)[:2][0], args, rtol=1e-6
    )


def test_second_derivatives():
    """`jax.hessian` and reverse over reverse through the early-stopped
    decompositions: those of the fixed-depth call at the depth used, and for
    Lanczos on s A_0 with f = log also the closed form -|b|^2 / s^2 (the
    quadrature b^T log(s A_0) b is |b|^2 log s plus a constant). They were NaN
    (the zero block an early end leaves in T made JAX's `eigh` rule divide by
    zero) or failed (reverse mode through the `while_loop`)."""
    n, d, s = 14, 14, 1.3
    A0 = jnp.asarray(path_laplacian(n)) + jnp.eye(n)
    b = jnp.asarray(np.random.default_rng(5).normal(size=n))
    cases = {"lanczos": jnp.log, "arnoldi": lambda H: jax.scipy.linalg.expm(-H)}
    for method, fn in cases.items():

        def quadratic(s, depth=None):
            options = {"tol": 1e-6} if depth is None else {}
            y = krylovjax.funm_action(
                fn,  # noqa: B023
                s * A0,
                b,
                d if depth is None else depth,
                method=method,  # noqa: B023
                **options,
            )
            return b @ (y[0] if depth is None else y)

        _, info = krylovjax.funm_action(fn, s * A0, b, d, tol=1e-6, method=method)
        depth = int(info.depth)
        assert depth < d, method
        want = jax.jit(jax.hessian(quadratic), static_argnums=1)(s, depth)
        if method == "lanczos":
            np.testing.assert_allclose(want, -(b @ b) / s**2, rtol=1e-10)
        for mode in (jax.jacfwd, jax.jacrev):
            got = jax.jit(mode(jax.grad(quadratic)))(s)
            np.testing.assert_allclose(got, want, rtol=1e-9, err_msg=method)


def test_vmap_gives_each_vector_its_own_depth():
    n = 40
    L = jnp.asarray(path_laplacian(n))
    rng = np.random.default_rng(3)
    B = np.stack([rng.normal(size=n), np.eye(n)[0], np.exp(-np.arange(n) / 2.0)])
    B = jnp.asarray(B)

    def one(b):
        return krylovjax.funm_action(
            lambda x: jnp.exp(-2 * x), L, b, 30, method="lanczos", tol=1e-8
        )

    ys, infos = jax.jit(jax.vmap(one))(B)
    depths = [int(k) for k in infos.depth]
    assert len(set(depths)) > 1
    for i in range(B.shape[0]):
        y, info = jax.jit(one)(B[i])
        assert int(info.depth) == depths[i]
        np.testing.assert_allclose(ys[i], y, rtol=1e-12, atol=1e-15)


def test_tol_errors():
    A, b = jnp.eye(3), jnp.ones(3)

    def call(**kw):
        return krylovjax.funm_action(jnp.exp, A, b, 2, method="lanczos", **kw)

    for bad in (0.0, -1e-3, 1.0):
        with pytest.raises(
            ValueError, match=r"`funm_action\(tol=...\)` must satisfy 0"
        ):
            call(tol=bad)
    for bad in ("1e-3", True, jnp.asarray(1e-3)):
        with pytest.raises(TypeError, match=r"`funm_action\(tol=...\)` must be a"):
            unchecked(krylovjax.funm_action)(
                jnp.exp, A, b, 2, method="lanczos", tol=bad
            )
    with pytest.raises(ValueError, match=r"`funm_action\(tol=...\)` is taken by"):
        krylovjax.funm_action(
            jnp.exp, A, b, 2, method="chebyshev", interval=(0.0, 2.0), tol=1e-3
        )
