"""`trace_funm`'s estimators: values against exact traces, statistics over many
keys, derivatives three ways, transforms, the matrix-free path and the errors.

Compiling is what these tests spend their time on, so every computation is jitted
and a test compiles one program with all its cases (the estimators where their
behaviour differs, as a dict of outputs); the gradient test takes its values,
derivatives by autodiff and by finite differences from one program.
"""

from functools import partial

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import (
    check_finite_differences,
    random_like,
    temp_bytes,
    unchecked,
    value_vjp_jvp,
)

import krylovjax

ESTIMATORS = ("hutchinson", "hutch++", "krylov-aware")
DEFLATED = ("hutch++", "krylov-aware")


def spd(n, seed=0, eigenvalues=None):
    """A random SPD matrix: eigenvalues in [0.5, 4] or the given ones."""
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    lam = rng.uniform(0.5, 4.0, n) if eigenvalues is None else np.asarray(eigenvalues)
    return jnp.asarray((Q * lam) @ Q.T)


def log_det(A):
    return float(np.linalg.slogdet(np.asarray(A))[1])


def symmetrise(A):
    return (A + A.T) / 2


# Few distinct eigenvalues: every Lanczos run and the block Krylov space of a
# single column are invariant after 4 vectors, so at d = 4 every quadrature is
# exact and each estimator is exactly unbiased.
FEW = spd(12, seed=1, eigenvalues=np.repeat([0.5, 1.0, 2.0, 4.0], 3))
FEW_OPTIONS = {
    "hutchinson": {},
    "hutch++": {"num_sketch": 2},
    "krylov-aware": {"num_sketch": 1},
}


def batches(cases, A, d, m, keys, f=jnp.log, matrix_free=0):
    """Estimates and infos for every key, of every `{estimator: options}` case, in
    one compiled program that vmaps over the keys; with `matrix_free=k`, also the
    estimates of the first k keys with `A` as a callable (`like=`), one key at a
    time (`lax.map`), for the deflated estimators. (Hutchinson's runs are the
    remainder's runs of both; `test_funm.py` checks its callable path.)"""

    @jax.jit
    def run(A, keys):
        def one(estimator, options, key, operator=A, like=None):
            return krylovjax.trace_funm(
                f,
                operator,
                key,
                d,
                num_probes=m,
                estimator=estimator,
                return_info=True,
                like=like,
                **options,
            )

        def callable_(estimator, options, key):
            like = jax.ShapeDtypeStruct(A.shape[:1], A.dtype)
            return one(estimator, options, key, lambda v: A @ v, like)[0]

        out = {}
        for e, o in cases.items():
            out[e] = jax.vmap(lambda key, e=e, o=o: one(e, o, key))(keys)
            if matrix_free and e in DEFLATED:
                one_by_one = jax.lax.map(
                    lambda key, e=e, o=o: callable_(e, o, key), keys[:matrix_free]
                )
                out[e] = (*out[e], one_by_one)
        return out

    return run(A, keys)


# The longest tests first, so that pytest-xdist's first batches (consecutive
# tests) share the work of two workers evenly.


def rbf_operator(points, noise):
    """A matrix-free RBF kernel plus noise, closing over a lengthscale."""

    def make(lengthscale):
        def mv(v):
            sq = jnp.sum((points[:, None] - points[None]) ** 2, axis=-1)
            K = jnp.exp(-sq / (2 * lengthscale**2))
            return K @ v + noise * v

        return mv

    return make


def test_gradients():
    """The deflated estimates' derivatives where the sketches span everything and
    every quadrature is exact, so that the estimate is log det for every A near
    the one given (Krylov-aware: its basis held fixed, each remainder quadrature
    differentiated by its first-order term; Hutch++: the exact derivative of the
    estimate): forward and reverse mode against finite differences in float64
    and against the closed form tr((A + s I)^{-1} (dA + ds I)), in a dense A, in
    an array `f` closes over (s) and in the lengthscale a matrix-free kernel
    closes over; and Hutch++ with a partial sketch against finite differences.
    One program serves all. (The Krylov-aware derivative with a partial sketch
    is not that of the estimate: the next test checks its mean.)"""
    n = 8
    options = {
        "hutch++": {"num_sketch": n, "num_probes": 2 * n + 1},
        "krylov-aware": {"num_sketch": 2, "num_probes": 3},
    }
    make = rbf_operator(jr.uniform(jr.key(2), (n, 2)), 0.1)

    def estimates(A, shift, lengthscale):
        out = {}
        for e, o in options.items():
            out[e] = krylovjax.trace_funm(
                lambda x: jnp.log(x + shift), A, jr.key(5), n, estimator=e, **o
            )
            out[e + " (lengthscale)"] = krylovjax.trace_funm(
                jnp.log,
                make(lengthscale),
                jr.key(5),
                n,
                estimator=e,
                like=jnp.zeros(n),
                **o,
            )
        out["hutch++ (partial)"] = krylovjax.trace_funm(
            lambda x: jnp.log(x + shift),
            A,
            jr.key(5),
            4,
            num_probes=6,
            estimator="hutch++",
            num_sketch=2,
        )
        return out

    shift, lengthscale = jnp.asarray(0.3, jnp.float64), jnp.asarray(0.4, jnp.float64)
    args = (spd(n, seed=2), shift, lengthscale)

    def kernel(lengthscale):
        return jax.vmap(make(lengthscale), out_axes=1)(jnp.eye(n))

    @jax.jit
    def run(args, tangents, cts):
        return value_vjp_jvp(estimates, args, tangents, cts)

    # Finite differences perturb A off the symmetric matrices, which Lanczos does
    # not represent: they differentiate A -> estimate((A + A^T) / 2), whose
    # derivatives are those of `run` composed with the (self-adjoint) projection.
    def symmetrised(args):
        return (symmetrise(args[0]), *args[1:])

    def derivatives(args, tangents, cts):
        value, (g, *rest), jvp = run(symmetrised(args), symmetrised(tangents), cts)
        return value, (symmetrise(g), *rest), jvp

    check_finite_differences(
        lambda A, *rest: estimates(symmetrise(A), *rest), derivatives, args, eps=1e-6
    )

    # The closed form, along random directions.
    tangents = random_like(jr.key(3), args)
    tangents = (symmetrise(tangents[0]), *tangents[1:])
    out, _, jvp = run(args, tangents, jax.tree.map(jnp.zeros_like, estimates(*args)))
    B = np.asarray(args[0]) + float(shift) * np.eye(n)
    K = np.asarray(kernel(lengthscale))
    dK = np.asarray(jax.jvp(kernel, (lengthscale,), (tangents[2],))[1])
    dense = np.trace(np.linalg.solve(B, np.asarray(tangents[0]))) + float(
        tangents[1]
    ) * np.trace(np.linalg.inv(B))
    for e in options:
        np.testing.assert_allclose(out[e], log_det(B), rtol=1e-10, err_msg=e)
        np.testing.assert_allclose(jvp[e], dense, rtol=1e-8, err_msg=e)
        name = e + " (lengthscale)"
        np.testing.assert_allclose(out[name], log_det(K), rtol=1e-10, err_msg=name)
        want = np.trace(np.linalg.solve(K, dK))
        np.testing.assert_allclose(jvp[name], want, rtol=1e-8, err_msg=name)


SECOND_DERIVATIVE_CASES = {
    "hutchinson": {"num_probes": 3},
    "hutch++": {"estimator": "hutch++", "num_probes": 5, "num_sketch": 2},
    "krylov-aware": {"estimator": "krylov-aware", "num_probes": 3, "num_sketch": 2},
    "block": {"num_probes": 4, "block_size": 2},
}


@pytest.mark.parametrize("name", SECOND_DERIVATIVE_CASES)
def test_second_derivatives(name):
    """`jax.hessian` and reverse over reverse, for every estimator and the block
    path, against central differences of the first derivative. On A(s) = s A_0
    with f = log, Hutchinson's and the Krylov-aware estimate are a constant plus a
    multiple of log s (their Krylov spaces do not depend on s), so their second
    derivative is also exactly minus their first over s: a closed form.
    (Hutch++'s sketch is of f(A), whose range depends on s.) These failed in
    reverse over reverse, and the Krylov-aware estimator's was 0."""
    A0 = spd(12, seed=3)
    options = SECOND_DERIVATIVE_CASES[name]
    s, h = 1.3, 1e-4
    d = 3 if name == "block" else 6

    def f(s):
        return krylovjax.trace_funm(jnp.log, s * A0, jr.key(0), d, **options)

    # The grad of a jitted function: differentiating its compiled program.
    first = jax.jit(jax.grad(jax.jit(f)))
    central = (first(s + h) - first(s - h)) / (2 * h)
    for mode in (jax.jacfwd, jax.jacrev):
        second = jax.jit(mode(first))(s)
        np.testing.assert_allclose(second, central, rtol=1e-6, err_msg=name)
        if name != "hutch++":
            want = -first(s) / s
            np.testing.assert_allclose(second, want, rtol=1e-10, err_msg=name)


def test_gradient_is_unbiased_over_many_keys():
    """Over S = 1000 keys, the mean derivative of each deflated estimate of
    tr(A^2) along a symmetric direction E (random plus the identity, so that the
    remainder carries most of the mean) is the exact 2 tr(A E), and forward and
    reverse mode agree key by key (a `jax.vmap` over the keys of `jax.jvp` and
    `jax.grad`, in one program).

    For f(x) = x^2 at d = 4 every quadrature is exact for every A, so Hutch++'s
    estimate is unbiased for tr(A^2) in a neighbourhood of A, and so is its exact
    derivative for 2 tr(A E); and so is each Krylov-aware first-order term
    (f'(A) w = 2 A w from the run): given the sketch, that derivative's mean is
    2 tr(Q^T A E Q) + 2 tr(P A E P) = 2 tr(A E), P the projection onto the
    complement of Q. The z-test fails falsely with probability below 1e-7 per
    estimator (|N(0, 1)| > 5.5)."""
    S, n, d, m = 1000, 12, 4, 6
    A = spd(n, seed=3)
    E = symmetrise(jr.normal(jr.key(8), (n, n), jnp.float64)) + jnp.eye(n)
    keys = jr.split(jr.key(9), S)

    @jax.jit
    def run(A, E, keys):
        def per_key(key, estimator):
            def estimate(A):
                return krylovjax.trace_funm(
                    jnp.square,
                    A,
                    key,
                    d,
                    num_probes=m,
                    estimator=estimator,
                    **FEW_OPTIONS[estimator],
                )

            forward = jax.jvp(estimate, (A,), (E,))[1]
            return forward, jnp.sum(jax.grad(estimate)(A) * E)

        return {e: jax.vmap(lambda k, e=e: per_key(k, e))(keys) for e in DEFLATED}

    want = 2 * float(jnp.sum(A * E))
    for estimator, (forward, reverse) in run(A, E, keys).items():
        forward, reverse = np.asarray(forward), np.asarray(reverse)
        np.testing.assert_allclose(reverse, forward, rtol=1e-9, atol=1e-9)
        z = abs(forward.mean() - want) / (forward.std(ddof=1) / np.sqrt(S))
        assert z < 5.5, (estimator, z)


def test_spectral_density_by_vmap_over_points():
    """A smoothed spectral density, phi(t) = tr g(t - A) / n for a Gaussian g of
    width 0.25, estimated at 41 points t by `jax.vmap` over t of `trace_funm`
    with an `f` that closes over t: each point equals its own call (value, and
    the derivative along a shift of A, in one program), and every point is
    within five standard errors of the exact density.

    At d = n the quadrature is exact, so each estimate is Hutchinson's for
    g(t I - A) with Rademacher probes, unbiased with the variance of the docs'
    table, 2 (||M||_F^2 - sum_i M_ii^2) / m. The bound fails falsely with
    probability below 2.4e-5 over the 41 points (5 sigma, 5.7e-7 each)."""
    n, m, width = 24, 8, 0.25
    eigenvalues = np.concatenate([np.linspace(0.5, 1.5, 12), np.linspace(3, 4, 12)])
    A = spd(n, seed=4, eigenvalues=eigenvalues)
    points = jnp.linspace(-0.5, 5.0, 41)
    key = jr.key(11)

    def g(x):
        return jnp.exp(-(x**2) / (2 * width**2)) / (np.sqrt(2 * np.pi) * width)

    def density(A, t):
        return krylovjax.trace_funm(lambda x: g(t - x), A, key, n, num_probes=m) / n

    @jax.jit
    def run(A):
        identity = jnp.eye(n)
        shifted = jax.vmap(
            lambda t: jax.jvp(lambda s: density(A + s * identity, t), (0.0,), (1.0,))
        )(points)
        one = [density(A, points[i]) for i in (0, 20, 33)]
        one_grad = jax.grad(lambda s: density(A + s * identity, points[20]))(0.0)
        return shifted, jnp.stack(one), one_grad

    (values, derivatives), one, one_grad = run(A)
    np.testing.assert_allclose(values[jnp.array([0, 20, 33])], one, rtol=1e-12)
    np.testing.assert_allclose(derivatives[20], one_grad, rtol=1e-10)

    lam, V = np.linalg.eigh(np.asarray(A))
    for t, value in zip(np.asarray(points), np.asarray(values), strict=True):
        M = (V * np.asarray(g(t - lam))) @ V.T
        exact = np.trace(M) / n
        sigma = np.sqrt(2 * (np.sum(M**2) - np.sum(np.diag(M) ** 2)) / m) / n
        assert abs(value - exact) <= 5 * sigma + 1e-12, (t, value, exact, sigma)


def test_float32():
    """The deflated estimators in float32, with sketches that span everything:
    the exact log-determinant to float32 accuracy, in one program."""
    n = 10
    A = spd(n, seed=6).astype(jnp.float32)
    options = {
        "hutch++": {"num_sketch": n, "num_probes": 2 * n + 1},
        "krylov-aware": {"num_sketch": 4, "num_probes": 5},
    }

    @jax.jit
    def run(A):
        return {
            e: krylovjax.trace_funm(jnp.log, A, jr.key(0), n, estimator=e, **o)
            for e, o in options.items()
        }

    for estimator, value in run(A).items():
        assert value.dtype == jnp.float32, estimator
        np.testing.assert_allclose(value, log_det(A), rtol=1e-4, err_msg=estimator)


def test_float32_values_whose_squares_overflow():
    """tr exp(A) in float32 with four eigenvalues from 30 to 45 (values up to
    3.5e19, whose squares overflow): Hutchinson's standard error and Hutch++'s
    sketch are those of `1e-20 exp`, scaled. The standard error was `inf`, and
    Hutch++ dropped a row of its sketch (rank 2 of 3)."""
    n = 20
    Q, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((n, n)))
    lam = np.concatenate([np.linspace(30.0, 45.0, 4), np.linspace(0.0, 1.0, n - 4)])
    A = jnp.asarray((Q * lam) @ Q.T, jnp.float32)

    @jax.jit
    def run(A):
        return {
            (estimator, scale): krylovjax.trace_funm(
                lambda x, s=scale: jnp.asarray(s, jnp.float32) * jnp.exp(x),
                A,
                jr.key(0),
                10,
                num_probes=12,
                estimator=estimator,
                return_info=True,
            )
            for estimator in ("hutchinson", "hutch++")
            for scale in (1.0, 1e-20)
        }

    out = run(A)
    for estimator in ("hutchinson", "hutch++"):
        (value, info), (small, small_info) = out[estimator, 1.0], out[estimator, 1e-20]
        np.testing.assert_allclose(value, 1e20 * small, rtol=1e-4, err_msg=estimator)
        assert int(info.rank) == int(small_info.rank), estimator
        assert np.isfinite(float(info.standard_error)), estimator
    # (Hutch++'s remainder terms are at the rounding of the sketch's, 1e12: their
    # standard error differs between the two scales by a few percent.)
    info, small_info = out["hutchinson", 1.0][1], out["hutchinson", 1e-20][1]
    np.testing.assert_allclose(
        info.standard_error, 1e20 * small_info.standard_error, rtol=1e-4
    )
    assert int(out["hutch++", 1.0][1].rank) == 3


def test_probes_keep_the_second_gram_schmidt_pass_in_float32():
    """The probes' Lanczos runs, vmapped, decide a step's second Gram-Schmidt
    pass together and take it where one of them needs it. Near an invariant
    subspace in float32 (an RBF kernel plus a small noise) they need it at
    different steps: without the pass the estimate was 0.98 off float64's from
    the same probes, and with it only where every probe needed it, NaN; with
    it, 2.5e-4. (Whether a key shows the latter depends on the rounding, and so
    on XLA's optimisations: this one does under the suite's settings.) The same
    under a second `vmap`, over two keys: all eight runs decide together."""
    n, d = 600, 200
    rng = np.random.default_rng(0)
    points = rng.uniform(size=(n, 2))
    squared = np.sum((points[:, None] - points[None]) ** 2, axis=-1)
    K = np.exp(-squared / (2 * 0.2**2)) + 0.01 * np.eye(n)

    def estimate(dtype, key):
        return krylovjax.trace_funm(
            jnp.log, jnp.asarray(K, dtype), key, d, num_probes=4
        )

    keys = [jr.key(4), jr.key(5)]
    want = [estimate(jnp.float64, key) for key in keys]
    np.testing.assert_allclose(estimate(jnp.float32, keys[0]), want[0], rtol=1e-2)
    both = jax.vmap(partial(estimate, jnp.float32))(jnp.stack(keys))
    np.testing.assert_allclose(both, want, rtol=1e-2)


# The cases of each estimator. Each case is its own copy in the program: vmapping
# the cases of one size together compiles more slowly than the copies do.
BREAKDOWN_CASES = {
    "krylov-aware": ("identity", "diagonal", "tiny"),
    "hutch++": ("identity", "tiny"),
}


def test_breakdown_is_finite():
    """A multiple of the identity, a diagonal matrix (every Krylov space invariant
    early, rank-deficient sketches) and n = 2 at d = n with a sketch that spans
    everything (hutch++: 2 = n columns; Krylov-aware: 3 > n): values and
    derivatives are finite, and exact where the estimator is; at n = 2 the deflated
    estimators are exact at full depth, and so is their gradient: d log det A / dA
    = A^{-1}. All cases in one program."""
    matrices = {
        "identity": 3.0 * jnp.eye(6),
        "diagonal": jnp.diag(jnp.arange(1.0, 7.0)),
        "tiny": spd(2, seed=3),
    }

    @jax.jit
    def run(matrices):
        out = {}
        for estimator, cases in BREAKDOWN_CASES.items():
            for case in cases:
                A = matrices[case]

                def estimate(A, estimator=estimator):
                    return krylovjax.trace_funm(
                        jnp.log,
                        A,
                        jr.key(0),
                        min(A.shape[0], 3),
                        num_probes=7,
                        estimator=estimator,
                        sampler="sphere",
                    )

                one = jnp.ones((), A.dtype)
                value, (grad,), tangent = value_vjp_jvp(
                    estimate, (A,), (jnp.eye(A.shape[0], dtype=A.dtype),), one
                )
                out[estimator, case] = value, grad, tangent
        return out

    for (estimator, case), (value, grad, tangent) in run(matrices).items():
        A = matrices[case]
        where = (estimator, case)
        assert np.isfinite(value), where
        assert np.all(np.isfinite(grad)), where
        assert np.isfinite(tangent), where
        if case != "diagonal":
            # A = cI: the remainder is constant on the sphere; n = 2: everything is
            # deflated (hutch++: a sketch of 2 > n columns).
            np.testing.assert_allclose(value, log_det(A), rtol=1e-10, err_msg=where)
        # Along the identity the estimate moves as tr(A^{-1}) exactly: the probes'
        # quadratic forms of log(A + tI) all move by their own 1/(a + t).
        if case == "identity":
            n = A.shape[0]
            np.testing.assert_allclose(tangent, n / 3.0, rtol=1e-10, err_msg=where)
        if case == "tiny":
            # The gradient of the symmetrised estimate, as a model that learns a
            # symmetric matrix sees it (Lanczos reads a symmetric A).
            inverse = np.linalg.inv(np.asarray(A))
            symmetric = (np.asarray(grad) + np.asarray(grad).T) / 2
            np.testing.assert_allclose(symmetric, inverse, atol=1e-8, err_msg=where)
            np.testing.assert_allclose(
                tangent, np.trace(inverse), rtol=1e-10, err_msg=where
            )


def test_low_rank_plus_identity():
    """A = I + U U^T with U of rank 3: the range of log(A) is that of U, which a
    sketch of f(A) with 3 columns finds, and the block Krylov space of A from 3
    Gaussian columns is invariant after two blocks: both deflated estimators are
    exact, with a zero standard error, where Hutchinson's has a standard error
    above 1 with as many products. The three in one program."""
    n, r = 40, 3
    U = jr.normal(jr.key(0), (n, r))
    A = jnp.eye(n) + U @ U.T
    exact = log_det(A)
    keys = jr.split(jr.key(1), 4)
    cases = {"hutch++": {"num_sketch": r}, "krylov-aware": {"num_sketch": r}}
    out = batches({**cases, "hutchinson": {}}, A, 6, 2 * r + 2, keys)
    for estimator in cases:
        estimates, info = out[estimator]
        np.testing.assert_allclose(estimates, exact, rtol=1e-9, err_msg=estimator)
        assert np.all(np.asarray(info.standard_error) < 1e-8), estimator
        assert np.all(np.asarray(info.rank) == r + (r if estimator != "hutch++" else 0))
    estimates, info = out["hutchinson"]
    assert np.all(np.asarray(info.standard_error) > 1.0)
    assert np.all(np.abs(np.asarray(estimates) - exact) > 1e-3)


def test_hutch_plus_plus_with_an_empty_sketch():
    """Hutch++ with a sketch of size 0 (the default for fewer than three probes,
    or `num_sketch=0`) is Hutchinson on all its probes: for a diagonal A,
    Rademacher probes and d at least the number of distinct eigenvalues, exact."""
    eigenvalues = jnp.arange(1.0, 7.0)
    A = jnp.diag(eigenvalues)
    exact = float(jnp.sum(jnp.log(eigenvalues)))

    @jax.jit
    def run(key):
        def one(m, k):
            return krylovjax.trace_funm(
                jnp.log,
                A,
                key,
                6,
                num_probes=m,
                estimator="hutch++",
                num_sketch=k,
                return_info=True,
            )

        return [one(1, None), one(2, None), one(5, 0)]

    for estimate, info in run(jr.key(0)):
        np.testing.assert_allclose(estimate, exact, rtol=1e-5)
        assert int(info.rank) == 0


PROBE_BATCH_CASES = {
    "hutchinson": ({}, 3),
    "hutch++": ({"estimator": "hutch++"}, 3),
    "krylov-aware": ({"estimator": "krylov-aware"}, 2),
    "blocks": ({"block_size": 2, "num_probes": 6}, 4),
}


@pytest.mark.parametrize("name", PROBE_BATCH_CASES)
def test_probes_in_batches(name):
    """`probes_per_batch` runs the probes a few at a time (a full batch and a
    smaller rest here, and for Hutch++ a sketch smaller than a batch): the same
    values, VJPs and JVPs as all at once, for every estimator and for blocks,
    float64. One program per estimator."""
    n, d, m = 24, 5, 7
    S = spd(n, seed=3)
    T = symmetrise(jr.normal(jr.key(1), (n, n), jnp.float64))
    options, size = PROBE_BATCH_CASES[name]
    options = {"num_probes": m, **options}

    @jax.jit
    def run(S, T):
        out = {}
        for batch in (None, size):

            def f(S, batch=batch):
                return krylovjax.trace_funm(
                    jnp.log, S, jr.key(2), d, probes_per_batch=batch, **options
                )

            out[batch is None] = value_vjp_jvp(f, (S,), (T,), 1.0)
        return out

    out = run(S, T)
    value, vjp, jvp = out[False]
    want_value, want_vjp, want_jvp = out[True]
    np.testing.assert_allclose(value, want_value, rtol=1e-12, err_msg=name)
    np.testing.assert_allclose(vjp[0], want_vjp[0], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(jvp, want_jvp, rtol=1e-9, err_msg=name)


def test_probes_in_batches_bound_the_memory():
    """With `probes_per_batch`, the compiled memory of the value and of the value
    and gradient is that of a batch, not of all the probes: 16 probes in batches
    of 2 take less than a third of what they take at once, and batches of 4 less
    than half. A diagonal operator as a callable, so that its gradient (n numbers)
    is small beside the bases."""
    n, d, m = 200, 8, 16
    w = jnp.linspace(1.0, 3.0, n)

    def estimate(w, batch):
        return krylovjax.trace_funm(
            jnp.log,
            lambda v: w * v,
            jr.key(0),
            d,
            num_probes=m,
            like=w,
            probes_per_batch=batch,
        )

    for transform in (lambda f: f, jax.value_and_grad):
        temp = {
            batch: temp_bytes(transform(partial(estimate, batch=batch)), w)
            for batch in (None, 4, 2)
        }
        assert 3 * temp[2] < temp[None], temp
        assert 2 * temp[4] < temp[None], temp


def test_deflated_blocks():
    """`deflated_blocks` sets how much of the block Krylov space is deflated. From
    one column, the space of A = I + U U^T (U of rank 5) is invariant after 6
    vectors: deflating 6 of d = 7 blocks gives log det A and its derivative in U,
    2 A^{-1} U, to rounding; the default, ceil(7/2) = 4 blocks, leaves part of U's
    range to the single remainder probe. One program."""
    n, r, d = 30, 5, 7
    U = jr.normal(jr.key(0), (n, r), jnp.float64)

    @jax.jit
    def run(U, key):
        def estimate(U, q):
            A = jnp.eye(n) + U @ U.T
            return krylovjax.trace_funm(
                jnp.log,
                A,
                key,
                d,
                num_probes=2,
                estimator="krylov-aware",
                deflated_blocks=q,
            )

        return {
            "default": jax.value_and_grad(estimate)(U, None),
            "six": jax.value_and_grad(estimate)(U, 6),
        }

    A = np.eye(n) + np.asarray(U @ U.T)
    out = run(U, jr.key(1))
    value, grad = out["six"]
    np.testing.assert_allclose(value, log_det(A), rtol=1e-12)
    np.testing.assert_allclose(grad, 2 * np.linalg.solve(A, U), rtol=1e-8, atol=1e-10)
    value, _ = out["default"]
    assert abs(float(value) - log_det(A)) > 1e-2


def test_unbiased_standard_error_matrix_free_vmap():
    """Over S = 4000 keys, the mean of each estimator's estimates is the exact
    trace, and the reported standard error matches the spread of the estimates.

    The quadratures are exact (`FEW`), so each estimate is an unbiased draw; the
    estimates of different keys are independent with finite variance, so by the
    central limit theorem z = |mean - exact| / (std / sqrt(S)) is close to
    |N(0, 1)|, and P(|N(0, 1)| > 5.5) = 3.8e-8: the bound fails falsely with
    probability below 1e-6 per estimator (with S = 4000 the normal approximation
    of the tail at 5.5 sigma is loose by a factor of a few for these bounded terms;
    still below 1e-6), below 3e-6 for the three. The deflated trace is exact for
    every sketch here, so the variance of an estimate is that of its remainder,
    whose unbiased estimate is the square of the standard error: the mean of
    `standard_error ** 2` over the keys is within 20% of the empirical variance
    (the relative noise of both is about sqrt(2 / S) times the kurtosis factor, a
    few percent; 20% is over five of its standard deviations). The three
    estimators run in one program, vmapped over the keys, which also gives the
    deflated estimators' estimates of the first keys with `A` a callable, key by
    key: the same values, as matrix-free, `jit` and `vmap` must."""
    S, m = 4000, 6
    exact = log_det(FEW)
    keys = jr.split(jr.key(7), S)
    out = batches(FEW_OPTIONS, FEW, 4, m, keys, matrix_free=3)
    for estimator, (estimates, info, *one_by_one) in out.items():
        # A callable with `like=` gives the dense matrix's estimate for the same
        # key; `jax.vmap` over keys gives the estimates of the keys one at a time.
        assert len(one_by_one) == (estimator in DEFLATED), estimator
        for values in one_by_one:
            np.testing.assert_allclose(
                estimates[:3], values, rtol=1e-10, err_msg=estimator
            )
        estimates = np.asarray(estimates)
        z = abs(estimates.mean() - exact) / (estimates.std(ddof=1) / np.sqrt(S))
        assert z < 5.5, (estimator, z)
        variance = estimates.var(ddof=1)
        reported = float(np.mean(np.asarray(info.standard_error) ** 2))
        assert abs(reported / variance - 1) < 0.2, (estimator, reported, variance)
        assert info.num_products == m * 4


def _traced(call):
    def traced(*args, **kwargs):
        return jax.eval_shape(lambda: call(*args, **kwargs))

    return traced


def test_errors():
    key, A = jr.key(0), spd(4)
    trace = _traced(krylovjax.trace_funm)
    unchecked_trace = _traced(unchecked(krylovjax.trace_funm))
    with pytest.raises(
        ValueError, match=r"`trace_funm\(estimator=...\)` must be one of 'hutchinson'"
    ):
        unchecked_trace(jnp.log, A, key, 2, num_probes=2, estimator="hutch")
    with pytest.raises(ValueError, match=r"`trace_funm\(num_sketch=...\)` applies to"):
        trace(jnp.log, A, key, 2, num_probes=2, num_sketch=1)
    with pytest.raises(
        ValueError, match=r"`trace_funm\(num_sketch=...\)` must leave at least one"
    ):
        trace(jnp.log, A, key, 2, num_probes=4, estimator="hutch++", num_sketch=2)
    with pytest.raises(
        ValueError, match=r"`trace_funm\(num_sketch=...\)` must be below `num_probes`"
    ):
        trace(jnp.log, A, key, 2, num_probes=3, estimator="krylov-aware", num_sketch=3)
    with pytest.raises(
        ValueError, match=r"`trace_funm\(num_probes=...\)` must be at least 2"
    ):
        trace(jnp.log, A, key, 2, num_probes=1, estimator="krylov-aware")
    with pytest.raises(
        ValueError, match=r"`trace_funm\(deflated_blocks=...\)` applies to"
    ):
        trace(jnp.log, A, key, 2, num_probes=2, deflated_blocks=1)
    with pytest.raises(
        ValueError, match=r"`trace_funm\(deflated_blocks=...\)` must be at most `d`"
    ):
        trace(
            jnp.log,
            A,
            key,
            2,
            num_probes=2,
            estimator="krylov-aware",
            deflated_blocks=3,
        )
    with pytest.raises(TypeError, match=r"`trace_funm\(num_sketch=...\)` must be a"):
        unchecked_trace(
            jnp.log, A, key, 2, num_probes=4, estimator="hutch++", num_sketch=1.5
        )
    with pytest.raises(
        TypeError, match=r"`trace_funm\(return_info=...\)` must be a bool"
    ):
        unchecked_trace(jnp.log, A, key, 2, num_probes=2, return_info="yes")
    with pytest.raises(
        TypeError,
        match=r"`trace_funm\(estimator='hutch\+\+'\)` takes real float32 or float64",
    ):
        trace(
            jnp.log,
            A.astype(jnp.complex128),
            key,
            2,
            num_probes=4,
            estimator="hutch++",
        )
    with pytest.raises(
        ValueError, match=r"`trace_funm\(probes_per_batch=...\)` must be at most"
    ):
        trace(jnp.log, A, key, 2, num_probes=2, probes_per_batch=3)
    with pytest.raises(
        ValueError, match=r"`trace_funm\(probes_per_batch=...\)` must be a multiple"
    ):
        trace(jnp.log, A, key, 2, num_probes=4, block_size=2, probes_per_batch=3)
    with pytest.raises(
        TypeError, match=r"`trace_funm\(probes_per_batch=...\)` must be a Python int"
    ):
        unchecked_trace(jnp.log, A, key, 2, num_probes=4, probes_per_batch=2.0)
    with pytest.raises(ValueError, match=r"`trace_funm\(sampler=...\)` must be one of"):
        unchecked_trace(
            jnp.log, A, key, 2, num_probes=4, estimator="krylov-aware", sampler="x"
        )
