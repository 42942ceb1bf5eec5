"""`funm_action` and `trace_funm`: values against dense references, statistics of the
trace estimate, gradients against three oracles, operator kinds, transforms, errors.

The references are SciPy and NumPy on the dense matrix: `scipy.linalg.expm`,
`fractional_matrix_power`, `logm`, and $V f(\\Lambda) V^H$ from `numpy.linalg.eigh`.
The trace estimator is also written in NumPy with the same probes (the docstring says
how they are drawn from the key), and its gradient by the Daleckii--Krein formula.
Every computation is jitted, several cases per program, to keep the file fast.
"""

import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.scipy.linalg
import numpy as np
import pytest
import scipy.linalg
from helpers import Linear, full_operator, run_on_four_devices, spd, unchecked
from jax.test_util import check_grads

import krylovjax

N = 10
KINDS = ("dense", "bcoo", "closure", "module")
expm = jax.scipy.linalg.expm


# ------------------------------------------------------------------- problems


def general(n=N, seed=2, dtype=np.float64):
    """A non-normal matrix of norm about 1."""
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(n, n))
    if np.issubdtype(dtype, np.complexfloating):
        A = A + 1j * rng.normal(size=(n, n))
    return (A / np.sqrt(n) + np.triu(np.ones((n, n)), 1) / n).astype(dtype)


def vector(n=N, seed=1, dtype=np.float64):
    rng = np.random.default_rng(seed)
    b = rng.normal(size=n)
    if np.issubdtype(dtype, np.complexfloating):
        b = b + 1j * rng.normal(size=n)
    return b.astype(dtype)


def sym_funm(S, f):
    """f(S) for a Hermitian S by eigh, in NumPy."""
    w, V = np.linalg.eigh(S)
    return (V * f(w)) @ V.conj().T


def symmetrise(kind, params):
    """The parameters of `full_operator(kind, ...)` made symmetric. Finite differences
    perturb a matrix off the symmetric ones, which Lanczos does not represent, so
    the gradient checks differentiate through this, as a model that learns a
    symmetric matrix does."""
    if kind == "bcoo":
        n = round(np.sqrt(params.shape[0]))
        i, j = np.divmod(np.arange(n * n), n)
        return (params + params[j * n + i]) / 2
    if kind == "module":
        return Linear((params.weight + params.weight.T) / 2)
    return (params + params.T) / 2


def relative_error(x, y):
    return float(np.linalg.norm(np.asarray(x) - y) / np.linalg.norm(y))


def decreasing(errors):
    return all(e1 > e2 for e1, e2 in zip(errors, errors[1:], strict=False))


def cycle(n):
    """The adjacency matrix of the cycle graph C_n: bipartite for even n, so the
    Rayleigh quotient b^T A b of a vertex is 0. Eigenvalues 2 cos(2 pi k / n), most
    of them double, so the Krylov space of any b is invariant after about n / 2
    vectors."""
    C = np.roll(np.eye(n), 1, axis=0)
    return C + C.T


def resolvent(shift, H):
    """(shift I - H)^{-1}: a matrix function cheaper to compile than `expm`."""
    eye = jnp.eye(H.shape[0], dtype=H.dtype)
    return jnp.linalg.solve(shift.astype(H.dtype) * eye - H, eye)


SCALAR = {
    "exp": (lambda x: jnp.exp(-x), lambda w: np.exp(-w)),
    "inv_sqrt": (lambda x: x**-0.5, lambda w: w**-0.5),
    "log": (jnp.log, np.log),
}
DEPTHS = (2, 5, N)


# --------------------------------------------------------------------- values


def test_lanczos_matches_dense_references_and_converges():
    S, b = spd(), vector()

    @jax.jit
    def run(S, b):
        return {
            name: [krylovjax.funm_action(f, S, b, d, method="lanczos") for d in DEPTHS]
            for name, (f, _) in SCALAR.items()
        }

    results = run(jnp.asarray(S), jnp.asarray(b))
    references = {
        "exp": scipy.linalg.expm(-S) @ b,
        "inv_sqrt": scipy.linalg.fractional_matrix_power(S, -0.5).real @ b,
        "log": scipy.linalg.logm(S).real @ b,
    }
    for name, (_, f_np) in SCALAR.items():
        np.testing.assert_allclose(sym_funm(S, f_np) @ b, references[name], rtol=1e-9)
        errors = [relative_error(y, references[name]) for y in results[name]]
        assert errors[-1] < 1e-12, (name, errors)
        assert decreasing(errors), (name, errors)


def test_arnoldi_expm_matches_scipy_and_converges():
    dtypes = (np.float64, np.complex128)
    problems = [(general(dtype=t), vector(dtype=t)) for t in dtypes]

    @jax.jit
    def run(problems):
        # The convergence in d for float64; the converged value for complex128.
        return [
            [
                krylovjax.funm_action(expm, A, b, d, method="arnoldi")
                for d in (DEPTHS if A.dtype == jnp.float64 else DEPTHS[-1:])
            ]
            for A, b in problems
        ]

    results = run(jax.tree.map(jnp.asarray, problems))
    for dtype, (A, b), ys in zip(dtypes, problems, results, strict=True):
        reference = scipy.linalg.expm(A) @ b
        errors = [relative_error(y, reference) for y in ys]
        assert ys[-1].dtype == dtype
        assert errors[-1] < 1e-12, (dtype, errors)
        assert decreasing(errors), (dtype, errors)


def test_complex_hermitian_and_complex_valued_f():
    S_c, b_c = spd(dtype=np.complex128), vector(dtype=np.complex128)
    S, b = spd(), vector()

    def schroedinger(x):
        # exp(-i x), with the cast to complex explicit (strict promotion).
        return jnp.exp(-1j * x.astype(jnp.complex128))

    @jax.jit
    def run(S_c, b_c, S, b):
        hermitian = krylovjax.funm_action(
            lambda x: jnp.exp(-x), S_c, b_c, N, method="lanczos"
        )
        propagator = krylovjax.funm_action(schroedinger, S, b, N, method="lanczos")
        return hermitian, propagator

    hermitian, propagator = run(*map(jnp.asarray, (S_c, b_c, S, b)))
    assert hermitian.dtype == propagator.dtype == jnp.complex128
    np.testing.assert_allclose(hermitian, scipy.linalg.expm(-S_c) @ b_c, rtol=1e-11)
    np.testing.assert_allclose(propagator, scipy.linalg.expm(-1j * S) @ b, rtol=1e-11)


def test_operator_kinds_agree_with_dense():
    S, A, b = jnp.asarray(spd()), jnp.asarray(general()), jnp.asarray(vector())
    kinds = {kind: (full_operator(kind, -S), full_operator(kind, A)) for kind in KINDS}

    @jax.jit
    def run(params):
        out = {}
        for kind, ((_, build_s), (_, build_a)) in kinds.items():
            p_s, p_a = params[kind]
            out[kind] = (
                krylovjax.funm_action(jnp.exp, build_s(p_s), b, 6, method="lanczos"),
                krylovjax.funm_action(
                    lambda H: resolvent(jnp.asarray(3.0), H),
                    build_a(p_a),
                    b,
                    6,
                    method="arnoldi",
                ),
            )
        return out

    out = run({kind: (s[0], a[0]) for kind, (s, a) in kinds.items()})
    for kind in KINDS:
        for got, want in zip(out[kind], out["dense"], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_float32():
    S, b = spd(), vector()
    y = jax.jit(lambda S, b: krylovjax.funm_action(jnp.log, S, b, N, method="lanczos"))(
        jnp.asarray(S, jnp.float32), jnp.asarray(b, jnp.float32)
    )
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, sym_funm(S, np.log) @ b, rtol=1e-4, atol=1e-5)


def test_bfloat16_action_to_bfloat16_accuracy():
    """exp(A) b for bfloat16 A and b with spectrum in [10, 12], by both methods (JAX
    has no bfloat16 `eigh` or `expm`): bfloat16, and within one bfloat16 epsilon of
    exp(A) b, norm-wise (the exact value rounded to bfloat16 is within 0.15 of
    one). There e^lambda has the relative error of lambda's absolute one, so this
    needs the decomposition and the small matrix worked in float32: rounding T to
    bfloat16 (spacing 1/16 near 11) alone costs 1.5 epsilons here."""
    A = jnp.asarray(spd(8, low=10.0, high=12.0), jnp.bfloat16)
    b = jnp.asarray(vector(8), jnp.bfloat16)

    @jax.jit
    def run(A, b):
        return (
            krylovjax.funm_action(jnp.exp, A, b, 8, method="lanczos"),
            krylovjax.funm_action(expm, A, b, 8, method="arnoldi"),
        )

    expected = scipy.linalg.expm(np.asarray(A, np.float64)) @ np.asarray(b, np.float64)
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    for y in run(A, b):
        assert y.dtype == jnp.bfloat16
        assert relative_error(np.asarray(y, np.float64), expected) < eps


def test_zero_vector_gives_zeros_and_finite_gradients():
    """f(0) is infinite for a logarithm; a zero `b` still gives zeros."""
    S, A, zero = jnp.asarray(spd()), jnp.asarray(general()), jnp.zeros(N)

    @jax.jit
    def run(S, A, b):
        def log_action(S, b):
            return krylovjax.funm_action(jnp.log, S, b, 4, method="lanczos")

        def resolvent_action(A, b):
            return krylovjax.funm_action(
                lambda H: resolvent(jnp.asarray(3.0), H), A, b, 4, method="arnoldi"
            )

        values = (log_action(S, b), resolvent_action(A, b))
        grads = (
            jax.grad(lambda S, b: log_action(S, b).sum(), argnums=(0, 1))(S, b),
            jax.grad(lambda A, b: resolvent_action(A, b).sum(), argnums=(0, 1))(A, b),
        )
        return values, grads

    values, grads = run(S, A, zero)
    for y in values:
        np.testing.assert_array_equal(y, np.zeros(N))
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


def test_breakdown_is_exact_with_finite_gradients():
    """Three distinct eigenvalues: the Krylov space is invariant after three steps,
    and the tridiagonal matrix of six steps has a repeated eigenvalue (the zero
    block after the breakdown), where JAX's own `eigh` rule divides by zero. The
    result is exact, and so is its derivative in `b` (the approximation equals
    f(S) b for every b near it), in reverse and forward mode."""
    rng = np.random.default_rng(3)
    Q, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    S = (Q * np.array([1.0, 1, 1, 2, 2, 4, 4, 4])) @ Q.T
    S = (S + S.T) / 2
    b, c = vector(8), vector(8, seed=5)

    def loss(S, b):
        return krylovjax.funm_action(jnp.log, S, b, 6, method="lanczos") @ c

    @jax.jit
    def run(S, b):
        value = krylovjax.funm_action(jnp.log, S, b, 6, method="lanczos")
        g_S, g_b = jax.grad(loss, argnums=(0, 1))(S, b)
        _, tangent = jax.jvp(lambda b: loss(S, b), (b,), (c,))
        return value, g_S, g_b, tangent

    value, g_S, g_b, tangent = run(jnp.asarray(S), jnp.asarray(b))
    F = sym_funm(S, np.log)
    np.testing.assert_allclose(value, F @ b, rtol=1e-10)
    assert bool(jnp.isfinite(g_S).all())
    np.testing.assert_allclose(g_b, F.T @ c, rtol=1e-9)
    np.testing.assert_allclose(tangent, c @ F @ c, rtol=1e-9)

    # JAX's own `eigh` rule on the same tridiagonal matrix gives nan (even with the
    # logarithm kept away from the zero block), so the finite gradients above come
    # from funm_action's rule.
    dec = krylovjax.lanczos(jnp.asarray(S), jnp.asarray(b), 6)

    def naive(diagonal, off_diagonal):
        T = jnp.diag(diagonal) + jnp.diag(off_diagonal, 1) + jnp.diag(off_diagonal, -1)
        lam, V = jnp.linalg.eigh(T)
        return V @ (jnp.log(jnp.where(lam > 0.5, lam, 1.0)) * V[0]) @ c[:6]

    grads = jax.jit(jax.grad(naive, argnums=(0, 1)))(dec.diagonal, dec.off_diagonal)
    assert not all(bool(jnp.isfinite(g).all()) for g in grads)


def test_breakdown_where_f_is_infinite_at_the_rayleigh_quotient():
    """C6 from a vertex: the Krylov space is invariant after 4 vectors (the
    eigenvalues are +-1 and +-2), and what the small matrix holds beyond them is
    zero, as is the Rayleigh quotient b^T A b (the graph is bipartite), where 1/x
    is infinite; with Arnoldi the zero block makes H singular. f(A) b = A^{-1} b
    exactly, for every b, for a shift s that f closes over, and along A itself
    (A + sI and (1 + t) A have the same Krylov spaces), so the derivatives in b and
    s and along A are closed forms; the rest of the gradient in A is finite.
    Reverse and forward mode, both methods (Lanczos at d = 5, Arnoldi at d = 6)."""
    A, b, s = jnp.asarray(cycle(6)), jnp.eye(6)[0], jnp.asarray(0.0)
    c, db = jnp.asarray(vector(6, seed=5)), jnp.asarray(vector(6, seed=6))

    def action(method, A, b, s):
        if method == "lanczos":
            return krylovjax.funm_action(lambda x: 1 / (x + s), A, b, 5, method=method)

        def inv(H):
            return jnp.linalg.inv(H + s * jnp.eye(H.shape[0], dtype=H.dtype))

        return krylovjax.funm_action(inv, A, b, 6, method=method)

    @jax.jit
    def run(A, b, s):
        out = {}
        for method in ("lanczos", "arnoldi"):
            value, pullback = jax.vjp(partial(action, method), A, b, s)
            tangents = (A, db, jnp.ones_like(s))
            _, tangent = jax.jvp(partial(action, method), (A, b, s), tangents)
            out[method] = (value, pullback(c), tangent)
        return out

    inverse = np.linalg.inv(np.asarray(A))
    y = inverse[:, 0]
    for value, (g_A, g_b, g_s), tangent in run(A, b, s).values():
        np.testing.assert_allclose(value, y, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(g_b, inverse @ c, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(g_s, -c @ inverse @ y, rtol=1e-12)
        assert bool(jnp.isfinite(g_A).all())
        np.testing.assert_allclose(np.sum(g_A * A), -c @ y, rtol=1e-12)
        np.testing.assert_allclose(
            tangent, -y + inverse @ db - inverse @ y, rtol=1e-12, atol=1e-14
        )


def test_trace_breakdown_where_f_is_infinite_at_the_rayleigh_quotient():
    """Two disjoint edges (eigenvalues +-1, both double): every probe's Krylov
    space is invariant after 2 vectors, and a Rademacher probe z with
    z0 z1 = -z2 z3 has Rayleigh quotient exactly 0, where 1/x is infinite. The
    estimate of tr A^{-1} at d = 4 equals the same estimator in NumPy, and its
    gradient is finite, with the closed form along A itself (the estimate is
    homogeneous of degree -1 in A)."""
    A, key, m = jnp.asarray(np.kron(np.eye(2), [[0.0, 1.0], [1.0, 0.0]])), jr.key(0), 8
    Z = probes(key, "rademacher", m, 4)
    assert np.any(np.einsum("mi,ij,mj->m", Z, np.asarray(A), Z) == 0)
    value, grad = jax.jit(
        jax.value_and_grad(
            lambda A: krylovjax.trace_funm(lambda x: 1 / x, A, key, 4, num_probes=m)
        )
    )(A)
    same_probes = np.mean(np.einsum("mi,ij,mj->m", Z, np.linalg.inv(A), Z))
    np.testing.assert_allclose(value, same_probes, rtol=1e-12, atol=1e-14)
    assert bool(jnp.isfinite(grad).all())
    np.testing.assert_allclose(np.sum(grad * A), -same_probes, rtol=1e-12)


# ------------------------------------------------------------------ gradients


def test_check_grads_fwd_and_rev():
    """Finite differences in float64, forward and reverse mode, with respect to the
    operator's arrays, `b`, and an array that `f` closes over: Lanczos on a BCOO
    matrix, and Arnoldi on a complex callable (one program for both)."""
    n, d = 6, 4
    p_bcoo, build_bcoo = full_operator("bcoo", spd(n))
    p_closure, build_closure = full_operator("closure", general(n, dtype=np.complex128))
    b, b_c = jnp.asarray(vector(n)), jnp.asarray(vector(n, dtype=np.complex128))

    def call(p_bcoo, p_closure, b, b_c, t):
        lanczos = krylovjax.funm_action(
            lambda x: (t + x) ** -0.5,
            build_bcoo(symmetrise("bcoo", p_bcoo)),
            b,
            d,
            method="lanczos",
        )
        arnoldi = krylovjax.funm_action(
            lambda H: resolvent(3 + t, H),
            build_closure(p_closure),
            b_c,
            d,
            method="arnoldi",
        )
        return lanczos, arnoldi

    args = (p_bcoo, p_closure, b, b_c, jnp.asarray(0.8))
    check_grads(jax.jit(call), args, order=1, modes=("fwd", "rev"), rtol=1e-6)


@pytest.mark.parametrize("method", ["lanczos", "arnoldi"])
def test_custom_rules_match_autodiff(method):
    """The decompositions' rules (the default) against JAX's own rules through
    them (`adjoint="autodiff"`), with a random cotangent."""
    if method == "lanczos":
        A, f = jnp.asarray(spd()), jnp.log
    else:
        A = jnp.asarray(general())

        def f(H):
            return resolvent(jnp.asarray(3.0), H)

    b, ct = jnp.asarray(vector()), jnp.asarray(vector(seed=7))

    @jax.jit
    def run(A, b):
        results = []
        for adjoint in ("custom_jvp", "autodiff"):

            def call(A, b, adjoint=adjoint):
                return krylovjax.funm_action(f, A, b, 6, method=method, adjoint=adjoint)

            out, pullback = jax.vjp(call, A, b)
            results.append((out, pullback(ct)))
        return results

    (out_c, grads_c), (out_a, grads_a) = run(A, b)
    np.testing.assert_allclose(out_c, out_a, rtol=1e-12)
    for g_c, g_a in zip(grads_c, grads_a, strict=True):
        np.testing.assert_allclose(g_c, g_a, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("method", ["lanczos", "arnoldi"])
def test_closed_form_time_derivative(method):
    """d/dt exp(tA) b = A exp(tA) b, through an `f` that closes over t."""
    if method == "lanczos":
        A = -jnp.asarray(spd())

        def y(t, b):
            return krylovjax.funm_action(
                lambda x: jnp.exp(t * x), A, b, N, method="lanczos"
            )

    else:
        A = jnp.asarray(general())

        def y(t, b):
            return krylovjax.funm_action(
                lambda H: expm(t * H), A, b, N, method="arnoldi"
            )

    b, c, t = jnp.asarray(vector()), jnp.asarray(vector(seed=4)), jnp.asarray(0.7)

    @jax.jit
    def run(t, b):
        _, tangent = jax.jvp(lambda t: y(t, b), (t,), (jnp.ones_like(t),))
        return tangent, jax.grad(lambda t: y(t, b) @ c)(t)

    tangent, grad = run(t, b)
    A_np = np.asarray(A)
    expected = A_np @ scipy.linalg.expm(0.7 * A_np) @ np.asarray(b)
    np.testing.assert_allclose(tangent, expected, rtol=1e-10)
    np.testing.assert_allclose(grad, expected @ np.asarray(c), rtol=1e-10)


def test_vmap_under_jit():
    """A batch of times and vectors, and the gradient for each."""
    S = jnp.asarray(spd())
    bs = jnp.stack([jnp.asarray(vector(seed=s)) for s in range(3)])
    ts = jnp.asarray([0.5, 1.0, 2.0])

    def heat(t, b):
        return krylovjax.funm_action(
            lambda x: jnp.exp(-t * x), S, b, N, method="lanczos"
        )

    out, grads = jax.jit(
        jax.vmap(lambda t, b: (heat(t, b), jax.grad(lambda t: heat(t, b).sum())(t)))
    )(ts, bs)
    for t, b, y, g in zip(ts, bs, out, grads, strict=True):
        E = scipy.linalg.expm(-float(t) * np.asarray(S))
        np.testing.assert_allclose(y, E @ np.asarray(b), rtol=1e-10)
        np.testing.assert_allclose(
            g, -(np.asarray(S) @ E @ np.asarray(b)).sum(), rtol=1e-9
        )


# -------------------------------------------------------------- trace estimate


def probes(key, sampler, m, n):
    """The probes `trace_funm` draws, as its docstring says."""
    if sampler == "rademacher":
        return np.asarray(jr.rademacher(key, (m, n), jnp.float64))
    z = np.asarray(jr.normal(key, (m, n), jnp.float64))
    if sampler == "sphere":
        z = z * np.sqrt(n) / np.linalg.norm(z, axis=1, keepdims=True)
    return z


def variance(M, sampler):
    """The variance of one probe's z^T M z for a real symmetric M (the docstring's
    formulas)."""
    n = M.shape[0]
    frobenius = np.sum(M**2)
    if sampler == "rademacher":
        return 2 * (frobenius - np.sum(np.diag(M) ** 2))
    if sampler == "normal":
        return 2 * frobenius
    return 2 * n / (n + 2) * (frobenius - np.trace(M) ** 2 / n)


SAMPLERS = ("rademacher", "normal", "sphere")


def test_trace_matches_numpy_estimator_and_exact_trace():
    S, key, m = spd(), jr.key(11), 200
    functions = {name: SCALAR[name] for name in ("log", "exp")}

    cases = [("log", sampler) for sampler in SAMPLERS] + [("exp", "rademacher")]

    @jax.jit
    def run(S):
        return {
            (name, sampler): krylovjax.trace_funm(
                functions[name][0], S, key, N, num_probes=m, sampler=sampler
            )
            for name, sampler in cases
        }

    estimates = run(jnp.asarray(S))
    for (name, sampler), estimate in estimates.items():
        M = sym_funm(S, functions[name][1])
        # The same probes in NumPy, with the exact f(S): equal at d = n.
        Z = probes(key, sampler, m, N)
        same_probes = np.mean(np.einsum("mi,ij,mj->m", Z, M, Z))
        np.testing.assert_allclose(estimate, same_probes, rtol=1e-11)
        # The exact trace is within four standard errors (a fixed seed: no flakes;
        # for a random seed this would fail about once in 16 000 runs).
        standard_error = np.sqrt(variance(M, sampler) / m)
        assert abs(float(estimate) - np.trace(M)) < 4 * standard_error, (name, sampler)


def test_trace_quadrature_error_falls_with_d():
    """Gauss quadrature: each probe's error falls quickly as d grows."""
    S, key, m = spd(low=0.1, high=10.0), jr.key(0), 8
    depths = (1, 2, 3, 5, N)
    estimates = jax.jit(
        lambda S: [
            krylovjax.trace_funm(jnp.log, S, key, d, num_probes=m) for d in depths
        ]
    )(jnp.asarray(S))
    Z = probes(key, "rademacher", m, N)
    exact = np.mean(np.einsum("mi,ij,mj->m", Z, sym_funm(S, np.log), Z))
    errors = [abs(float(e) - exact) for e in estimates]
    assert errors[-1] < 1e-10 * abs(exact), errors
    assert decreasing(errors), errors


def test_trace_exact_for_diagonal_with_rademacher():
    w = jnp.linspace(1.0, 5.0, N)
    est = jax.jit(
        lambda A: krylovjax.trace_funm(jnp.log, A, jr.key(3), N, num_probes=3)
    )(jnp.diag(w))
    np.testing.assert_allclose(est, np.sum(np.log(np.asarray(w))), rtol=1e-12)


def test_trace_half_precision():
    """float16 and bfloat16 matrices: the quadratures run in float32 (JAX has no
    half-precision `eigh`) and the estimate comes back in the matrix's dtype,
    within one epsilon of the same estimator in NumPy."""
    S, key, m = spd(8, low=10.0, high=12.0), jr.key(1), 4
    Z = probes(key, "rademacher", m, 8)
    dtypes = (jnp.float16, jnp.bfloat16)
    estimates = jax.jit(
        lambda mats: [
            krylovjax.trace_funm(jnp.log, A, key, 8, num_probes=m) for A in mats
        ]
    )([jnp.asarray(S, dtype) for dtype in dtypes])
    for dtype, estimate in zip(dtypes, estimates, strict=True):
        M = sym_funm(np.asarray(jnp.asarray(S, dtype), np.float64), np.log)
        same_probes = np.mean(np.einsum("mi,ij,mj->m", Z, M, Z))
        assert estimate.dtype == dtype
        eps = float(jnp.finfo(dtype).eps)
        assert abs(float(estimate) - same_probes) < eps * abs(same_probes)


def daleckii_krein(S, f, df, W):
    """The gradient of <W, f(S)> with respect to a symmetric S (distinct
    eigenvalues)."""
    w, V = np.linalg.eigh(S)
    gap = w[:, None] - w[None, :]
    same = np.eye(len(w), dtype=bool)
    F = np.where(same, df(w)[:, None], (f(w)[:, None] - f(w)[None, :]) / (gap + same))
    return V @ (F * (V.T @ W @ V)) @ V.T


def test_derivatives_with_small_eigenvalues_next_to_a_large_one():
    """Eigenvalues 1e-3 and 5e-2 beside 1e4. The logarithm changes fast between the
    two small ones, so their divided difference must be the quotient, not the mean
    of f' that serves eigenvalues too close to tell apart (close for the pair's own
    size, not the spectrum's: with the spectrum's, the derivative was 5x too
    large). At d = n the result is log(S) b exactly, and the log-det estimate is
    exact for its probes: both derivatives are the Daleckii--Krein ones."""
    rng = np.random.default_rng(7)
    Q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
    S = (Q * np.array([1e-3, 5e-2, 1e4])) @ Q.T
    S = (S + S.T) / 2
    b, c, E = vector(3), vector(3, seed=5), jnp.asarray(spd(n=3, seed=8))
    key, m = jr.key(2), 4

    def action(S):
        y = krylovjax.funm_action(
            jnp.log, (S + S.T) / 2, jnp.asarray(b), 3, method="lanczos"
        )
        return y @ c

    def logdet(S):
        return krylovjax.trace_funm(jnp.log, (S + S.T) / 2, key, 3, num_probes=m)

    grad, tangent, grad_trace = jax.jit(
        lambda S: (
            jax.grad(action)(S),
            jax.jvp(action, (S,), (E,))[1],
            jax.grad(logdet)(S),
        )
    )(jnp.asarray(S))
    W = np.outer(c, b)
    expected = daleckii_krein(S, np.log, lambda w: 1 / w, (W + W.T) / 2)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(grad, expected, rtol=1e-7, atol=1e-9 * scale)
    np.testing.assert_allclose(tangent, np.sum(expected * np.asarray(E)), rtol=1e-7)
    Z = probes(key, "rademacher", m, 3)
    expected = daleckii_krein(S, np.log, lambda w: 1 / w, Z.T @ Z / m)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(grad_trace, expected, rtol=1e-7, atol=1e-9 * scale)


def _step(g):
    """tanh of width g / 20 centred between 1 and 1 + g, its NumPy twin and slope."""

    def slope(w):
        t = np.exp(-2 * np.abs(w - (1 + g / 2)) / (g / 20))
        return 4 * t / (1 + t) ** 2 / (g / 20)

    return (
        lambda x: jnp.tanh((x - (1 + g / 2)) / (g / 20)),
        lambda w: np.tanh((w - (1 + g / 2)) / (g / 20)),
        slope,
    )


_OSCILLATION = (
    lambda x: jnp.exp(-1000j * x.astype(jnp.complex64)),
    lambda w: np.exp(-1000j * w),
    lambda w: -1000j * np.exp(-1000j * w),
)


@pytest.mark.parametrize(
    ("dtype", "g", "functions", "rtol"),
    [
        (np.float32, 2e-3, _step(2e-3), 2e-3),
        (np.float64, 2e-6, _step(2e-6), 1e-8),
        (np.float32, 2e-3, _OSCILLATION, 2e-3),
    ],
    ids=["float32-step", "float64-step", "complex64-oscillation"],
)
def test_derivatives_where_f_changes_fast_between_close_eigenvalues(
    dtype, g, functions, rtol
):
    """Eigenvalues 1, 1 + g and 3, and f stepping or oscillating between the two
    close ones. Their divided difference is the quotient (f_i - f_j) / g, well
    resolved here, not the mean of f' (about 0 for the step, whose f' is the same
    at both ends). The directional derivative of c^T f(S) b along a symmetric E,
    at d = n, against the Daleckii--Krein formula in float64 NumPy (which agrees
    with mpmath at 60 digits to 1e-10), to the dtype's accuracy: in float32 the
    result moves by about eps ||S|| / g relative (2e-4) as the eigenvalues and
    eigenvectors of the close pair do, and JAX's own `eigh` rule errs as much."""
    f, f_np, df_np = functions
    rng = np.random.default_rng(0)
    Q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
    S = (Q * np.array([1.0, 1.0 + g, 3.0])) @ Q.T
    E = rng.normal(size=(3, 3))
    S, E, b, c = (
        np.asarray(x, dtype)
        for x in ((S + S.T) / 2, E + E.T, vector(3), vector(3, seed=5))
    )

    def y(S):
        out = krylovjax.funm_action(f, S, jnp.asarray(b), 3, method="lanczos")
        return out @ jnp.asarray(c, out.dtype)

    _, tangent = jax.jit(lambda S, E: jax.jvp(y, (S,), (E,)))(S, E)
    W = np.outer(c, b).astype(np.float64)
    expected = np.sum(daleckii_krein(S.astype(np.float64), f_np, df_np, W) * E)
    np.testing.assert_allclose(complex(tangent), expected, rtol=rtol)


def test_derivatives_reach_a_python_float_that_f_closes_over():
    """`grad` and `jvp` called with a Python float t that `f` closes over (traced as
    a scalar that is not an array): d/dt c^T exp(-tS) b = -c^T S exp(-tS) b, the
    same as for an array t."""
    S, b, c = jnp.asarray(spd()), jnp.asarray(vector()), vector(seed=4)

    def y(t):
        fn = lambda x: jnp.exp(-t * x)  # noqa: E731
        return krylovjax.funm_action(fn, S, b, N, method="lanczos") @ c

    S_np = np.asarray(S)
    expected = -c @ S_np @ scipy.linalg.expm(-0.7 * S_np) @ np.asarray(b)
    np.testing.assert_allclose(jax.grad(y)(0.7), expected, rtol=1e-10)
    np.testing.assert_allclose(jax.jvp(y, (0.7,), (1.0,))[1], expected, rtol=1e-10)
    np.testing.assert_allclose(jax.grad(y)(jnp.asarray(0.7)), expected, rtol=1e-10)


def test_logdet_gradient_closed_forms():
    """The gradient of the log-det estimate equals the Daleckii--Krein gradient for
    the drawn probes, which is S^{-1} when their mean outer product is the identity;
    with many probes it is within five standard errors of S^{-1}. Forward mode
    gives the matching directional derivative."""
    S, key, m = spd(n=6), jr.key(5), 2000
    E = jnp.asarray(spd(n=6, seed=8))

    def logdet(S):
        return krylovjax.trace_funm(jnp.log, (S + S.T) / 2, key, 6, num_probes=m)

    grad, tangent = jax.jit(
        lambda S: (jax.grad(logdet)(S), jax.jvp(logdet, (S,), (E,))[1])
    )(jnp.asarray(S))
    Z = probes(key, "rademacher", m, 6)
    expected = daleckii_krein(S, np.log, lambda w: 1 / w, Z.T @ Z / m)
    np.testing.assert_allclose(grad, expected, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(tangent, np.sum(expected * np.asarray(E)), rtol=1e-9)
    inverse = np.linalg.inv(S)
    np.testing.assert_allclose(
        daleckii_krein(S, np.log, lambda w: 1 / w, np.eye(6)), inverse, rtol=1e-10
    )
    per_probe = np.stack(
        [daleckii_krein(S, np.log, lambda w: 1 / w, np.outer(z, z)) for z in Z]
    )
    standard_error = per_probe.std(axis=0) / np.sqrt(m)
    assert np.all(np.abs(np.asarray(grad) - inverse) < 5 * standard_error + 1e-12)


def test_trace_operator_kinds():
    S, key = spd(n=6), jr.key(2)
    like = jax.ShapeDtypeStruct((6,), jnp.float64)
    kinds = {kind: full_operator(kind, S) for kind in KINDS}

    @jax.jit
    def run(params):
        return {
            kind: krylovjax.trace_funm(
                jnp.log, build(params[kind]), key, 6, num_probes=4, like=like
            )
            for kind, (_, build) in kinds.items()
        }

    out = run({kind: p for kind, (p, _) in kinds.items()})
    for kind in KINDS:
        np.testing.assert_allclose(out[kind], out["dense"], rtol=1e-12)


def test_trace_check_grads():
    """Finite differences for the estimate with an `equinox.Module` operator."""
    kind = "module"
    params, build = full_operator(kind, spd(n=6))
    key, t = jr.key(2), jnp.asarray(0.3)

    def est(params, t):
        A = build(symmetrise(kind, params))
        return krylovjax.trace_funm(
            lambda x: jnp.log(x + t), A, key, 4, num_probes=3, like=jnp.zeros(6)
        )

    check_grads(jax.jit(est), (params, t), order=1, modes=("fwd", "rev"), rtol=1e-6)


def test_trace_complex_hermitian_and_autodiff():
    S_c, S, key, m = spd(n=6, dtype=np.complex128), spd(n=6), jr.key(4), 50

    @jax.jit
    def run(S_c, S):
        est = krylovjax.trace_funm(jnp.log, S_c, key, 6, num_probes=m)
        grads = [
            jax.grad(
                lambda S, adjoint=adjoint: krylovjax.trace_funm(
                    jnp.log, S, key, 5, num_probes=m, adjoint=adjoint
                )
            )(S)
            for adjoint in ("custom_jvp", "autodiff")
        ]
        return est, grads

    est, grads = run(jnp.asarray(S_c), jnp.asarray(S))
    assert est.dtype == jnp.float64
    Z = probes(key, "rademacher", m, 6)
    M = sym_funm(S_c, np.log)
    same_probes = np.mean(np.einsum("mi,ij,mj->m", Z, M, Z)).real
    np.testing.assert_allclose(est, same_probes, rtol=1e-10)
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-8, atol=1e-10)


def test_trace_training_step_with_fresh_keys():
    S = jnp.asarray(spd())

    @jax.jit
    def step(S, key):
        return jax.value_and_grad(
            lambda S: krylovjax.trace_funm(jnp.log, S, key, 8, num_probes=16)
        )(S)

    (v1, g1), (v2, g2) = step(S, jr.key(0)), step(S, jr.key(1))
    assert float(v1) != float(v2)
    assert bool(jnp.isfinite(g1).all() and jnp.isfinite(g2).all())


# --------------------------------------------------------------------- errors


A_ERR, B_ERR = jnp.eye(3) * 2.0, jnp.ones(3)


def test_funm_action_errors():
    funm = krylovjax.funm_action
    with pytest.raises(ValueError, match=r"`funm_action\(method=...\)` must be one of"):
        unchecked(funm)(jnp.exp, A_ERR, B_ERR, 2, method="eig")
    with pytest.raises(TypeError, match="method"):
        unchecked(funm)(jnp.exp, A_ERR, B_ERR, 2)
    with pytest.raises(TypeError, match=r"`funm_action\(f=...\)` must be a callable"):
        unchecked(funm)("exp", A_ERR, B_ERR, 2, method="lanczos")
    with pytest.raises(ValueError, match=r"`funm_action\(d=...\)` must be an int >= 1"):
        funm(jnp.exp, A_ERR, B_ERR, 0, method="lanczos")
    with pytest.raises(ValueError, match=r"`funm_action\(d=...\)` must be at most n"):
        funm(jnp.exp, A_ERR, B_ERR, 4, method="lanczos")
    with pytest.raises(TypeError, match=r"`funm_action\(d=...\)` must be a Python int"):
        unchecked(funm)(jnp.exp, A_ERR, B_ERR, 2.0, method="lanczos")
    with pytest.raises(ValueError, match=r"`funm_action\(b=...\)` must be one vector"):
        unchecked(funm)(jnp.exp, A_ERR, jnp.ones((3, 2)), 2, method="lanczos")
    with pytest.raises(TypeError, match=r"`funm_action\(b=...\)` must have a floating"):
        unchecked(funm)(jnp.exp, A_ERR, jnp.ones(3, int), 2, method="lanczos")
    with pytest.raises(ValueError, match=r"`funm_action\(A=...\)` must be a square"):
        unchecked(funm)(jnp.exp, jnp.ones((3, 2)), B_ERR, 2, method="lanczos")
    # Errors about the vector name it `b`, the argument of `funm_action`.
    with pytest.raises(
        ValueError, match=r"`funm_action\(b=...\)` must have first axis of length 3"
    ):
        unchecked(funm)(jnp.exp, A_ERR, jnp.ones(4), 2, method="lanczos")
    with pytest.raises(ValueError, match=r"the same shape as `b`, \(3,\)"):
        funm(jnp.exp, lambda v: v[:2], B_ERR, 2, method="lanczos")
    with pytest.raises(TypeError, match=r"`funm_action\(reorthogonalize=...\)`"):
        unchecked(funm)(
            jnp.exp, A_ERR, B_ERR, 2, method="lanczos", reorthogonalize="yes"
        )
    with pytest.raises(ValueError, match=r"`funm_action\(adjoint=...\)` must be one"):
        unchecked(funm)(jnp.exp, A_ERR, B_ERR, 2, method="lanczos", adjoint="vjp")
    # A matrix function where a scalar one belongs, and the other way round.
    with pytest.raises(ValueError, match=r"`funm_action\(f=...\)` must map the \(2,\)"):
        funm(jnp.sum, A_ERR, B_ERR, 2, method="lanczos")
    with pytest.raises(
        ValueError, match=r"`funm_action\(f=...\)` must map the \(2, 2\)"
    ):
        funm(jnp.diag, A_ERR, B_ERR, 2, method="arnoldi")
    with pytest.raises(TypeError, match=r"`funm_action\(f=...\)` must map .* floating"):
        funm(lambda x: (x > 0).astype(jnp.int32), A_ERR, B_ERR, 2, method="lanczos")
    # A matrix function where a scalar one belongs fails inside `f`: the error names
    # `f` and the method that takes a matrix function.
    with pytest.raises(
        ValueError,
        match=r"`funm_action\(f=...\)` must be a scalar function, applied "
        r"elementwise to the \(3,\) eigenvalues .* Expected A to be a \(batched\) "
        r"square matrix.* use `method=\"arnoldi\"`",
    ):
        funm(expm, A_ERR, B_ERR, 3, method="lanczos")


def test_trace_funm_errors():
    key, trace = jr.key(0), krylovjax.trace_funm
    with pytest.raises(TypeError, match=r"`trace_funm\(like=...\)` is required"):
        trace(jnp.log, lambda x: 2 * x, key, 2, num_probes=2)
    with pytest.raises(ValueError, match=r"`trace_funm\(like=...\)` must have shape"):
        unchecked(trace)(
            jnp.log, lambda x: 2 * x, key, 2, num_probes=2, like=jnp.ones((3, 2))
        )
    with pytest.raises(
        ValueError, match=r"`trace_funm\(like=...\)` must have shape \(3"
    ):
        unchecked(trace)(jnp.log, A_ERR, key, 2, num_probes=2, like=jnp.ones(4))
    with pytest.raises(ValueError, match=r"`trace_funm\(sampler=...\)` must be one of"):
        unchecked(trace)(jnp.log, A_ERR, key, 2, num_probes=2, sampler="gauss")
    with pytest.raises(ValueError, match=r"`trace_funm\(num_probes=...\)` must be an"):
        trace(jnp.log, A_ERR, key, 2, num_probes=0)
    with pytest.raises(
        ValueError, match=r"`trace_funm\(d=...\)` must be at most n = 3, the size of"
    ):
        trace(jnp.log, A_ERR, key, 4, num_probes=2)
    with pytest.raises(ValueError, match=r"the same shape as `like`, \(3,\)"):
        trace(jnp.log, lambda v: v[:2], key, 2, num_probes=2, like=jnp.ones(3))
    with pytest.raises(
        TypeError, match=r"`trace_funm\(A=...\)` must be a square array, .* type list"
    ):
        unchecked(trace)(jnp.log, [[1.0, 0.0], [0.0, 1.0]], key, 2, num_probes=2)
    with pytest.raises(
        TypeError, match=r"`trace_funm\(key=...\)` must be one JAX PRNG"
    ):
        unchecked(trace)(jnp.log, A_ERR, 0, 2, num_probes=2)
    with pytest.raises(TypeError, match=r"`trace_funm\(A=...\)` must have a floating"):
        unchecked(trace)(jnp.log, jnp.eye(3, dtype=int), key, 2, num_probes=2)
    with pytest.raises(ValueError, match=r"`trace_funm\(A=...\)` must be a square"):
        unchecked(trace)(jnp.log, jnp.ones((3, 2)), key, 2, num_probes=2)
    with pytest.raises(TypeError, match=r"`trace_funm\(f=...\)` must be a callable"):
        unchecked(trace)(None, A_ERR, key, 2, num_probes=2)
    with pytest.raises(ValueError, match=r"`trace_funm\(f=...\)` must map the \(2,\)"):
        trace(jnp.sum, A_ERR, key, 2, num_probes=2)
    with pytest.raises(
        ValueError, match=r"`trace_funm\(f=...\)` must be a scalar function"
    ):
        trace(expm, A_ERR, key, 2, num_probes=2)
    # The m bases are one batch: too many probes name `num_probes`, before XLA's
    # allocator would fail.
    with pytest.raises(
        ValueError,
        match=r"`trace_funm\(num_probes=...\)` is too large: the batch of "
        r"1099511627776 Lanczos bases",
    ):
        trace(jnp.log, A_ERR, key, 2, num_probes=2**40)


def test_row_sharded_matrix_on_both_mesh_kinds():
    # Four forced host devices in a subprocess; see
    # `_decomposition_sharding_script.py`.
    record = run_on_four_devices("_decomposition_sharding_script.py")
    assert len(record) == 9, record
    assert max(record["Explicit, outside set_mesh"]) < 1e-12, record
    for kind in ("Auto", "Explicit"):
        for layout, spec in (
            ("sharded", ["x", None]),
            ("replicated", [None, None]),
        ):
            errors = record[f"{kind}, x0 {layout}"]
            assert len(errors) == 9, record
            assert max(errors) < 1e-12, record
            if kind == "Explicit":
                assert record[f"{kind}, x0 {layout}, basis"] == spec, record


_CONCURRENT_EIGH_SCRIPT = """
import jax, jax.numpy as jnp, jax.random as jr, numpy as np
import krylovjax
jax.config.update("jax_enable_x64", True)
Q = np.linalg.qr(np.random.default_rng(0).standard_normal((6, 6)))[0]
S = jnp.asarray(Q @ np.diag(np.arange(1.0, 7.0)) @ Q.T)

def logdet(S):
    return krylovjax.trace_funm(jnp.log, S, jr.key(5), 6, num_probes=2000)

f = jax.jit(lambda S: (jax.grad(logdet)(S), jax.jvp(logdet, (S,), (S,))[1]))
for _ in range(300):
    jax.block_until_ready(f(S))
print("done")
"""


def test_trace_estimate_and_its_derivatives_in_one_program_do_not_hang():
    # A value and two derivatives of a trace estimate in one jitted program run
    # several batches of small eigendecompositions at once. jaxlib's batched CPU
    # `eigh` waits, on its own thread pool, for the parts it gave that pool, and two
    # at once hung within 300 calls on two cores. In a subprocess, with a timeout.
    result = subprocess.run(
        [sys.executable, "-c", _CONCURRENT_EIGH_SCRIPT],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("done")
