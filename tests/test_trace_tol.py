"""`trace_funm(tol=...)`: the depth each probe's Lanczos run stops at against a sweep
of depths, the quadrature error report, derivatives (exact for the estimate
returned) three ways, and argument errors.

The sweep is the quadrature of one probe at every depth, from one Lanczos run in
NumPy with full reorthogonalisation, against the exact $z^\\top \\log(K)\\, z$.
"""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import check_finite_differences, random_like, unchecked, value_vjp_jvp

import krylovjax


def spd_kernel(n, seed=0):
    """An RBF kernel matrix plus noise: condition number about 10^3."""
    x = np.random.default_rng(seed).uniform(size=n)
    K = np.exp(-((x[:, None] - x[None]) ** 2) / (2 * 0.3**2))
    return K + 1e-3 * np.eye(n)


def quadrature_sweep(A, z, d):
    """`||z||^2 e_0^T log(T_k) e_0` for k = 1, ..., d."""
    n = len(z)
    Q = np.zeros((n, d))
    alpha, beta = np.zeros(d), np.zeros(d)
    Q[:, 0] = z / np.linalg.norm(z)
    for k in range(d):
        w = A @ Q[:, k]
        alpha[k] = Q[:, k] @ w
        w -= Q[:, : k + 1] @ (Q[:, : k + 1].T @ w)
        w -= Q[:, : k + 1] @ (Q[:, : k + 1].T @ w)
        if k + 1 < d:
            beta[k] = np.linalg.norm(w)
            Q[:, k + 1] = w / beta[k]
    out = []
    for k in range(1, d + 1):
        T = np.diag(alpha[:k]) + np.diag(beta[: k - 1], 1) + np.diag(beta[: k - 1], -1)
        lam, V = np.linalg.eigh(T)
        out.append(z @ z * (V[0] ** 2 @ np.log(lam)))
    return np.array(out)


def test_depth_against_a_sweep_and_the_true_error():
    """One probe: its run stops at the smallest depth whose quadrature is within
    `tol` of the exact quadratic form, or a few steps more (the test runs every
    step up to 16, then every `k // 16`); the estimate is within `tol`, and the
    reported error is below `tol` and above the truth."""
    n, d, tol = 60, 60, 1e-8
    K = spd_kernel(n)
    key = jr.key(0)
    z = np.asarray(jr.rademacher(key, (1, n), jnp.float64))[0]
    w, V = np.linalg.eigh(K)
    exact = z @ (V @ (np.log(w) * (V.T @ z)))
    errors = np.abs(quadrature_sweep(K, z, d) - exact) / abs(exact)
    smallest = 1 + int(np.argmax(errors < tol))

    estimate, info = jax.jit(
        lambda K: krylovjax.trace_funm(
            jnp.log, K, key, d, num_probes=1, tol=tol, return_info=True
        )
    )(jnp.asarray(K))
    depth = int(info.products_made)
    assert smallest <= depth <= smallest + max(2, smallest // 8)
    assert abs(float(estimate) - exact) < tol * abs(exact)
    # The report bounds the true error here; it is conservative (about 800x):
    # it is funm_action's estimate for f(T) e_0, whose first entry, the
    # quadrature, converges about twice as fast.
    reported = float(info.quadrature_error)
    assert abs(float(estimate) - exact) <= reported <= tol * abs(float(estimate))


def test_derivatives_and_closed_form():
    """Hutchinson on a kernel matrix with a lengthscale (its derivative is the
    exact derivative of the estimate; the deflated estimators' is not, see
    `test_trace.py`): the default rules against
    JAX's own rules through the same early-stopped runs and against finite
    differences in forward and reverse mode; and on a diagonal matrix with three
    distinct eigenvalues, where every run ends exact at depth 3, the estimate is
    log det A and its gradient A^{-1}."""
    n, d, tol = 12, 12, 1e-6
    x = jnp.asarray(np.random.default_rng(1).uniform(size=n))
    key = jr.key(1)

    def call(adjoint):
        def f(lengthscale, noise):
            K = jnp.exp(-((x[:, None] - x[None]) ** 2) / (2 * lengthscale**2))
            A = K + noise * jnp.eye(n)
            return krylovjax.trace_funm(
                jnp.log,
                A,
                key,
                d,
                num_probes=6,
                tol=tol,
                adjoint=adjoint,
            )

        return f

    args = (jnp.asarray(0.4, jnp.float64), jnp.asarray(0.1, jnp.float64))
    tangents = random_like(jr.key(2), args)
    cts = jnp.asarray(1.3, jnp.float64)
    lam = jnp.asarray([1.0, 2.0, 2.0, 5.0, 1.0, 5.0], jnp.float64)

    def on_diagonal(lam):
        A = jnp.diag(lam)
        return krylovjax.trace_funm(
            jnp.log, A, key, 6, num_probes=4, tol=tol, return_info=True
        )

    @jax.jit
    def run(args, tangents, cts, lam):
        custom = value_vjp_jvp(call("custom_jvp"), args, tangents, cts)
        autodiff = value_vjp_jvp(call("autodiff"), args, tangents, cts)
        (value, info), grad = jax.value_and_grad(on_diagonal, has_aux=True)(lam)
        return custom, autodiff, value, info, grad

    custom, autodiff, value, info, grad = run(args, tangents, cts, lam)
    for got, want in zip(
        jax.tree.leaves(custom), jax.tree.leaves(autodiff), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    check_finite_differences(
        call("custom_jvp"),
        lambda *a: run(*a, lam)[0],
        args,
        rtol=1e-6,
    )
    np.testing.assert_allclose(value, np.sum(np.log(lam)), rtol=1e-12)
    np.testing.assert_allclose(grad, 1 / lam, rtol=1e-10)
    assert int(info.products_made) == 4 * 3


def test_depth_one():
    """At d = 1 (one product per run), `tol` has only that depth to choose: each
    estimator's value and gradient are those without `tol`, and every run makes
    its one product. d = 1 with `tol` failed at trace time."""
    A = jnp.diag(jnp.arange(1.0, 9.0, dtype=jnp.float64))
    estimators = ("hutchinson", "hutch++", "krylov-aware")

    @jax.jit
    def run(A):
        out = {}
        for estimator in estimators:
            for tol in (None, 1e-3):

                def f(A, estimator=estimator, tol=tol):
                    return krylovjax.trace_funm(
                        jnp.log,
                        A,
                        jr.key(0),
                        1,
                        num_probes=3,
                        estimator=estimator,
                        tol=tol,
                        return_info=True,
                    )

                out[estimator, tol is None] = jax.value_and_grad(f, has_aux=True)(A)
        return out

    out = run(A)
    for estimator in estimators:
        (value, info), grad = out[estimator, False]
        (want, _), want_grad = out[estimator, True]
        np.testing.assert_allclose(value, want, rtol=1e-14, err_msg=estimator)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-13, atol=1e-15)
        assert int(info.products_made) == info.num_products, estimator


@pytest.mark.parametrize("tol", [0.0, 1.0, -1e-3, "1e-6", True])
def test_tol_errors(tol):
    A = jnp.eye(4) * 2.0
    with pytest.raises((TypeError, ValueError), match=r"`trace_funm\(tol=...\)`"):
        unchecked(krylovjax.trace_funm)(jnp.log, A, jr.key(0), 2, num_probes=2, tol=tol)
