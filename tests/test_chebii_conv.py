"""Tests for `krylovjax.nn.ChebIIConv` against ChebNetII's equations.

The oracle is `chebnetii_reference`, the paper's propagation written out: a dense
Laplacian built from the adjacency (self-loops removed, an isolated node's inverse
degree 0), `L_hat = 2 L / lambda_max - I` applied transposed (messages along the
edges, as PyG's `propagate`), the coefficients `w_k = 2 / (K + 1) sum_j
relu(gamma_j) T_k(x_j)` and the `T_k` recurrence, all in Python loops. The closed
form is Chebyshev interpolation's exactness on polynomials: with `gamma_j = f(x_j)`
for `f` of degree at most `K`, the layer is `f(L_hat^T)`, evaluated here on an
eigendecomposition by NumPy.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import adam_losses, unchecked
from jax.experimental import sparse
from jax.test_util import check_vjp

from krylovjax.nn import ChebIIConv

N = 5
K = 3
# A directed graph (row -> col, weight): node 4 is isolated, (2, 2) is a self-loop,
# (1, 2) appears twice.
ROWS = np.array([0, 1, 1, 2, 2, 3, 3, 1])
COLS = np.array([1, 0, 2, 1, 2, 0, 2, 2])
WEIGHTS = np.array([0.5, 1.5, 2.0, 1.0, 0.9, 1.2, 0.3, 0.4])
# The BCOO matrix holds the edges and one padding entry (an index outside the
# matrix, whose value must be ignored).
INDICES = np.concatenate([np.stack([ROWS, COLS], axis=1), [[N, 1]]]).astype(np.int32)
PADDING = 7.0
# Filter values of mixed sign: the ReLU zeroes gamma_1.
GAMMA = np.array([0.8, -0.3, 1.2, 0.5])


def _inverse(x, power, xp):
    """`x ** -power`, 0 where `x == 0`, with a finite gradient there."""
    safe = xp.where(x == 0, 1.0, x)
    return xp.where(x == 0, 0.0, safe**-power)


def reference_laplacian(A, normalization, xp=jnp):
    """The Laplacian of the dense adjacency `A` (`xp` is `jnp` or `np`)."""
    n = A.shape[0]
    eye = xp.eye(n, dtype=A.dtype)
    A = A * (1.0 - eye)  # self-loops removed
    degree = A.sum(axis=1)
    if normalization is None:
        return degree[:, None] * eye - A
    if normalization == "sym":
        s = _inverse(degree, 0.5, xp)
        return eye - s[:, None] * A * s[None, :]
    return eye - _inverse(degree, 1.0, xp)[:, None] * A


def chebyshev_t(k, x):
    """T_k(x) by the three-term recurrence."""
    t0, t1 = 1.0, x
    if k == 0:
        return t0
    for _ in range(k - 1):
        t0, t1 = t1, 2.0 * x * t1 - t0
    return t1


def chebnetii_reference(gamma, x, A, normalization, lambda_max, nonnegative=True):
    """ChebNetII's propagation of `x` on the graph of `A`, from the paper's
    equations."""
    degree = gamma.shape[0] - 1
    n = A.shape[0]
    L = reference_laplacian(A, normalization)
    P = (2.0 * L / lambda_max - jnp.eye(n, dtype=A.dtype)).T
    values = jax.nn.relu(gamma) if nonnegative else gamma
    nodes = [np.cos((j + 0.5) * np.pi / (degree + 1)) for j in range(degree + 1)]
    w = []
    for k in range(degree + 1):
        total = sum(values[j] * chebyshev_t(k, nodes[j]) for j in range(degree + 1))
        w.append(2.0 / (degree + 1) * total)
    tx0 = x
    out = w[0] / 2.0 * tx0
    if degree >= 1:
        tx1 = P @ x
        out = out + w[1] * tx1
    for k in range(2, degree + 1):
        tx2 = 2.0 * (P @ tx1) - tx0
        out = out + w[k] * tx2
        tx0, tx1 = tx1, tx2
    return out


def _dense(data):
    """The dense adjacency of the edges' weights `data[:-1]` (the last entry is
    the BCOO padding)."""
    return jnp.zeros((N, N), data.dtype).at[ROWS, COLS].add(data[:-1])


def _bcoo(data):
    return sparse.BCOO((data, jnp.asarray(INDICES)), shape=(N, N))


def _close(actual, expected, rtol):
    """Entrywise relative error below `rtol`, relative to the largest entry where
    an entry is near zero."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    atol = rtol * np.max(np.abs(expected), initial=0.0)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


NAMES = {"sym": "sym", "rw": "rw", "None": None}
# The runs of the reference program: (normalisation, adjacency layout, the
# `nonnegative` flag, whether its VJP is checked). Both layouts and both flags get
# their gradients checked on "sym"; the other normalisations, whose Laplacians are
# ChebGraphConv's (gradients tested in test_cheb_conv.py), their output, here on
# the BCOO layout and in the closed form on the dense one. Each VJP of the layer
# adds about a second of compilation.
RUNS = {
    "sym_dense": ("sym", "dense", False, True),
    "sym_bcoo": ("sym", "bcoo", True, True),
    "rw_bcoo": ("rw", "bcoo", True, False),
    "None_bcoo": ("None", "bcoo", True, False),
}
VJP_RUNS = [run for run, (*_, vjp) in RUNS.items() if vjp]


def _layer(gamma, x, data, lam, run):
    """The layer of `run` as a function of `(gamma, X, data, lambda_max)`."""
    name, layout, nonnegative, _ = RUNS[run]
    conv = ChebIIConv(K, normalization=NAMES[name], nonnegative=nonnegative)
    conv = eqx.tree_at(lambda c: c.gamma, conv, gamma)
    adjacency = _dense(data) if layout == "dense" else _bcoo(data)
    return conv(adjacency, x, lambda_max=lam)


def _reference(gamma, x, data, lam, run):
    """`chebnetii_reference` for `run`, a function of the same arguments."""
    name, _, nonnegative, _ = RUNS[run]
    A = _dense(data)
    return chebnetii_reference(gamma, x, A, NAMES[name], lam, nonnegative)


@jax.jit
def _program(gamma, x, data, lam, cotangents):
    """The outputs of every run's layer and reference, and the VJPs of those of
    `VJP_RUNS`, the layer's of `cotangents[run]`, the reference's of
    `cotangents[run + "_ref"]`."""
    outputs, vjps = {}, {}
    for run in RUNS:
        for key, f in ((run, _layer), (f"{run}_ref", _reference)):
            f = functools.partial(f, run=run)
            if run in VJP_RUNS:
                outputs[key], vjp = jax.vjp(f, gamma, x, data, lam)
                vjps[key] = vjp(cotangents[key])
            else:
                outputs[key] = f(gamma, x, data, lam)
    return outputs, vjps


def _arguments():
    """`(gamma, X, data, lambda_max)`: the BCOO values hold the edge weights and
    the padding."""
    x = np.random.default_rng(0).standard_normal((N, 2))
    return GAMMA, x, np.concatenate([WEIGHTS, [PADDING]]), np.asarray(3.5)


def _cotangents(cotangent=None):
    """A cotangent for each VJP of `_program`: `cotangent`, or zeros."""
    cotangent = np.zeros((N, 2)) if cotangent is None else cotangent
    return {key: cotangent for run in VJP_RUNS for key in (run, f"{run}_ref")}


@functools.cache
def _against_reference():
    cotangent = np.random.default_rng(1).standard_normal((N, 2))
    result = _program(*_arguments(), _cotangents(cotangent))
    return jax.tree.map(np.asarray, result)


@pytest.mark.parametrize("run", list(RUNS))
def test_matches_reference_dense_and_sparse(run):
    outputs, vjps = _against_reference()
    _close(outputs[run], outputs[f"{run}_ref"], rtol=1e-12)
    if run not in VJP_RUNS:
        return
    # gamma, X, the BCOO values (edge weights and padding) and lambda_max.
    for got, expected in zip(vjps[run], vjps[f"{run}_ref"], strict=True):
        _close(got, expected, rtol=1e-12)
    g_gamma, _, g_data, _ = vjps[run]
    assert g_data[-1] == 0.0  # the padding entry
    assert g_data[4] == 0.0  # the self-loop, which is dropped
    assert np.count_nonzero(g_data) == len(WEIGHTS) - 1  # every other edge's
    if RUNS[run][2]:
        # gamma_1 < 0 is cut by the ReLU, and no other gamma_j.
        assert g_gamma[1] == 0.0
        assert np.count_nonzero(g_gamma) == K
    else:
        assert np.count_nonzero(g_gamma) == K + 1


def _forward(*args):
    """The layer's runs of `VJP_RUNS` as a function of `(gamma, X, data,
    lambda_max)`, evaluated by `_program`."""
    outputs, _ = _program(*args, _cotangents())
    return {run: outputs[run] for run in VJP_RUNS}


def _forward_vjp(*args):
    """`(_forward(*args), its VJP)`, from `_program`."""

    def vjp(cotangent):
        _, vjps = _program(*args, {**_cotangents(), **cotangent})
        runs = [vjps[run] for run in VJP_RUNS]
        return tuple(sum(grads) for grads in zip(*runs, strict=True))

    return _forward(*args), vjp


def test_gradients_match_finite_differences():
    # Central differences along a random direction (jax.test_util's check), every
    # evaluation taken from the program of the reference test: of gamma alone, then
    # of all four arguments.
    gamma, *rest = _arguments()

    def of_gamma(gamma):
        return _forward(gamma, *rest)

    def of_gamma_vjp(gamma):
        out, vjp = _forward_vjp(gamma, *rest)
        return out, lambda cotangent: vjp(cotangent)[:1]

    check_vjp(of_gamma, of_gamma_vjp, (gamma,))
    check_vjp(_forward, _forward_vjp, _arguments())


# lambda_max of each closed-form layer: "sym" runs with the default, 2.
LAMBDA_MAX = {"sym": 2.0, "rw": 1.7, "None": 9.0}


@functools.cache
def _closed_form():
    """The layers for `gamma_j = f(x_j)`, `f` a polynomial of degree `degree`, and
    for the default `gamma = 1`, on an undirected graph, from one program."""
    degree = 4
    f = np.polynomial.Polynomial(np.random.default_rng(2).standard_normal(degree + 1))
    # Undirected, weighted, with the isolated node 4.
    A = np.zeros((N, N))
    for i, j, w in [(0, 1, 1.0), (1, 2, 0.5), (2, 3, 2.0), (0, 3, 0.7)]:
        A[i, j] = A[j, i] = w
    x = np.random.default_rng(3).standard_normal((N, 3))
    convs = {}
    for name, normalization in NAMES.items():
        conv = ChebIIConv(degree, normalization=normalization, nonnegative=False)
        gamma = jnp.asarray(f(np.asarray(conv.nodes)))
        convs[name] = eqx.tree_at(lambda c: c.gamma, conv, gamma)

    @jax.jit
    def run(convs, identity, constant, A, x):
        # "sym" with the default lambda_max, for f and for the default gamma at
        # once: vmapped over gamma, the Chebyshev blocks are computed once.
        def sym(gamma):
            return eqx.tree_at(lambda c: c.gamma, convs["sym"], gamma)(A, x)

        gammas = jnp.stack([convs["sym"].gamma, identity.gamma])
        out = dict(zip(["sym", "identity"], jax.vmap(sym)(gammas), strict=True))
        for name in ("rw", "None"):
            out[name] = convs[name](A, x, lambda_max=LAMBDA_MAX[name])
        out["degree_0"] = constant(A, x)  # gamma_0 X
        return out

    constant = eqx.tree_at(lambda c: c.gamma, ChebIIConv(0), jnp.array([0.7]))
    out = jax.tree.map(np.asarray, run(convs, ChebIIConv(degree), constant, A, x))
    return f, A, x, out


@pytest.mark.parametrize("name", list(NAMES))
def test_polynomial_filter_is_exact(name):
    f, A, x, out = _closed_form()
    L = reference_laplacian(A, NAMES[name], xp=np)
    P = (2.0 * L / LAMBDA_MAX[name] - np.eye(N)).T
    eigenvalues, V = np.linalg.eig(P)
    expected = V @ (f(eigenvalues)[:, None] * np.linalg.solve(V, x))
    assert np.max(np.abs(expected.imag)) < 1e-12
    _close(out[name], expected.real, rtol=1e-12)


def test_default_gamma_is_the_identity():
    _, _, x, out = _closed_form()
    _close(out["identity"], x, rtol=1e-14)


def test_degree_zero_is_a_scalar():
    _, _, x, out = _closed_form()
    _close(out["degree_0"], 0.7 * x, rtol=1e-15)


def test_adam_steps_reduce_a_loss():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((N, 2))
    target = rng.standard_normal((N, 2))
    adjacency = _bcoo(np.concatenate([WEIGHTS, [PADDING]]))
    losses = adam_losses(
        ChebIIConv(K), lambda c: jnp.mean((c(adjacency, x) - target) ** 2), 5e-2
    )
    assert losses[3] < losses[0]


def test_errors():
    with pytest.raises(ValueError, match=r"`ChebIIConv\(K=\.\.\.\)`.*>= 0.*got -1"):
        ChebIIConv(-1)
    with pytest.raises(TypeError, match=r"`ChebIIConv\(K=\.\.\.\)`.*got 2\.0"):
        unchecked(ChebIIConv)(2.0)
    with pytest.raises(
        ValueError,
        match=r"`ChebIIConv\(normalization=\.\.\.\)` must be 'sym', 'rw' or None; "
        r"got 'laplacian'",
    ):
        unchecked(ChebIIConv)(K, normalization="laplacian")
    with pytest.raises(TypeError, match=r"`ChebIIConv\(nonnegative=\.\.\.\)`.*bool"):
        unchecked(ChebIIConv)(K, nonnegative="yes")
    conv = ChebIIConv(K)
    dense = np.ones((N, N))
    with pytest.raises(
        ValueError,
        match=r"`ChebIIConv\.__call__\(X=\.\.\.\)` must have shape \(N, F\).*"
        r"got shape \(5,\)",
    ):
        unchecked(conv)(dense, np.ones(N))
    with pytest.raises(
        ValueError,
        match=r"`ChebIIConv\.__call__\(adjacency=\.\.\.\)` must have shape "
        r"\(5, 5\) to match `X` of shape \(5, 2\); got shape \(4, 4\)",
    ):
        unchecked(conv)(np.ones((4, 4)), np.ones((N, 2)))
    with pytest.raises(
        ValueError, match=r"`ChebIIConv\.__call__\(lambda_max=\.\.\.\)`.*> 0.*got 0"
    ):
        conv(dense, np.ones((N, 2)), lambda_max=0.0)
