"""The defaults of `krylov` are safe, lean and differentiable in both modes.

- The default method is the scan: it never returns `nan` where the scan is finite
  (doubling's powers overflow for growing modes that `x0` never touches).
- One default rule serves forward and reverse mode.
- `jax.grad` with the defaults needs at most the compiled temporary memory of plain
  autodiff through a `lax.scan` plus a few chunks of adjoint vectors and one `(n, n)`
  product, for every form of loss.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, random_matrix
from hypothesis import example, given, settings, strategies as st
from jax.experimental import sparse

import krylovjax
from krylovjax.nn import KrylovGraphConv, LinearDynamics, StateSpaceConv


def _temp_bytes(fn, *args):
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


# ------------------------------------------------------------ the default method


def test_default_is_finite_where_the_scan_is():
    # A mode that grows (1.2^k overflows float32 from k = 487) and an x0 that never
    # touches it: the exact values are [0, 0.5^k]. Doubling forms A^512 = inf and
    # multiplies it by 0.
    A = jnp.diag(jnp.array([1.2, 0.5], jnp.float32))
    x0 = jnp.array([0.0, 1.0], jnp.float32)
    X = krylovjax.krylov(A, x0, 1024)
    assert bool(jnp.isfinite(X).all())
    exact = 0.5 ** np.arange(1024, dtype=np.float64)
    np.testing.assert_allclose(X[1], exact, rtol=1e-5, atol=1e-37)
    grad = jax.grad(lambda x: krylovjax.krylov(A, x, 1024)[:, :20].sum())(x0)
    np.testing.assert_allclose(grad, [sum(1.2**k for k in range(20)), 2.0], rtol=1e-5)
    # Doubling asked for explicitly keeps its documented limit.
    assert bool(jnp.isnan(krylovjax.krylov(A, x0, 1024, method="doubling")).any())


@pytest.mark.parametrize("d", [1024, 4096])
def test_default_matches_the_scan_on_a_reflection(d):
    # The scan reproduces a reflection's powers almost exactly; doubling's error
    # grows with d. The default is the scan itself.
    c, s = np.cos(0.4), np.sin(0.4)
    A = jnp.array([[c, s], [s, -c]], jnp.float32)
    x0 = jnp.array([1.0, 0.3], jnp.float32)
    X = krylovjax.krylov(A, x0, d)
    np.testing.assert_array_equal(X, krylovjax.krylov(A, x0, d, method="scan"))


# ------------------------------------------------------ forward mode by default


def _plain(A, x0, d):
    return krylovjax.krylov(A, x0, d, adjoint="autodiff")


@pytest.mark.parametrize("block", [None, 3])
def test_forward_and_reverse_modes_with_the_defaults(block):
    key_a, key_x = jax.random.split(jax.random.key(0))
    A = random_matrix(key_a, 4, jnp.float64, scale=0.5)
    x0 = jax.random.normal(key_x, (4,) if block is None else (4, block), jnp.float64)
    d = 70  # more than one chunk of the reverse pass

    def f(A, x0):
        return jnp.sum(jnp.sin(krylovjax.krylov(A, x0, d)))

    def g(A, x0):
        return jnp.sum(jnp.sin(_plain(A, x0, d)))

    tangents = (jnp.ones_like(A), jnp.ones_like(x0))
    assert_trees_close(jax.jvp(f, (A, x0), tangents), jax.jvp(g, (A, x0), tangents))
    assert_trees_close(jax.jacfwd(f, (0, 1))(A, x0), jax.jacfwd(g, (0, 1))(A, x0))
    assert_trees_close(jax.grad(f, (0, 1))(A, x0), jax.grad(g, (0, 1))(A, x0))
    _, lin = jax.linearize(f, A, x0)
    _, lin_ref = jax.linearize(g, A, x0)
    assert_trees_close(lin(*tangents), lin_ref(*tangents))
    hess = jax.hessian(lambda A: f(A, x0))(A)
    assert_trees_close(hess, jax.hessian(lambda A: g(A, x0))(A))
    rev_fwd = jax.jacrev(jax.jacfwd(lambda A: f(A, x0)))(A)
    assert_trees_close(rev_fwd, hess)


# (n, d, block) for every way the reverse pass splits its steps: chunks of 64 whose
# last one overlaps the one above (small vectors, 298 rows); a dense gradient added
# one step at a time (n = 70); blocks of rows with chunks of 20 that overlap by 2.
CHUNKING_CASES = [
    (8, 300, None),
    (8, 300, 2),
    (70, 40, None),
    (256, 100, None),
    (256, 100, 3),
]


@pytest.mark.parametrize("kind", ["dense", "bcoo", "callable"])
@pytest.mark.parametrize("n, d, block", CHUNKING_CASES)
def test_every_chunking_matches_autodiff(kind, n, d, block):
    A = random_matrix(jax.random.key(1), n, jnp.float64, scale=0.95)
    like = _sparse_like(A, jax.random.key(2))
    if kind == "bcoo":
        A = like.data
    shape = (n,) if block is None else (n, block)
    x0 = jax.random.normal(jax.random.key(3), shape, jnp.float64)
    W = jax.random.normal(jax.random.key(4), (n, d, *shape[1:]), jnp.float64)

    def loss(adjoint):
        def f(A, x0):
            X = krylovjax.krylov(_operator(kind, A, like), x0, d, adjoint=adjoint)
            return jnp.sum(jnp.tanh(X) * W)

        return f

    ours, plain = loss(None), loss("autodiff")
    for argnums in [(0, 1), 1]:
        assert_trees_close(
            jax.grad(ours, argnums)(A, x0), jax.grad(plain, argnums)(A, x0)
        )
    assert_trees_close(
        jax.grad(loss("custom_vjp"), (0, 1))(A, x0), jax.grad(plain, (0, 1))(A, x0)
    )
    if block is None and n * d <= 2800:
        # Second derivatives run the reverse pass's own derivatives: forward over
        # reverse and reverse over reverse, as Hessian-vector products.
        V = jnp.cos(jnp.arange(A.size, dtype=A.dtype)).reshape(A.shape)

        def hvps(f):
            g = jax.grad(f)
            fwd = jax.jvp(lambda A: g(A, x0), (A,), (V,))[1]
            rev = jax.grad(lambda A: jnp.vdot(g(A, x0), V))(A)
            return fwd, rev

        assert_trees_close(hvps(ours), hvps(plain))


def test_linear_transpose_with_the_defaults():
    # krylov and iterate are linear in x0 for a fixed linear step: JAX can transpose
    # them, which runs the hand-written reverse pass.
    A = random_matrix(jax.random.key(9), 4, jnp.float64)
    x0 = jnp.ones(4, jnp.float64)
    ct = jax.random.normal(jax.random.key(10), (4, 70), jnp.float64)
    want = jax.vjp(lambda x: _plain(A, x, 70), x0)[1](ct)
    got = jax.linear_transpose(lambda x: krylovjax.krylov(A, x, 70), x0)(ct)
    assert_trees_close(got, want)
    got = jax.linear_transpose(lambda x: krylovjax.iterate(lambda v: A @ v, x, 70), x0)(
        ct.T
    )
    assert_trees_close(got, want)


def test_iterate_forward_and_reverse_modes_with_the_defaults():
    W = random_matrix(jax.random.key(7), 4, jnp.float64, scale=0.5)
    x0 = (jnp.ones(4, jnp.float64), jnp.array(1.0, jnp.float64))

    def f(W, x0, adjoint="custom_jvp"):
        def step(s):
            return jnp.tanh(W @ s[0]), 0.9 * s[1] + s[0].sum()

        xs = krylovjax.iterate(step, x0, 30, adjoint=adjoint)
        return jnp.sum(xs[0] ** 2) + jnp.sum(jnp.sin(xs[1]))

    def g(W, x0):
        return f(W, x0, adjoint="autodiff")

    assert_trees_close(
        jax.jvp(lambda x: f(W, x), (x0,), (x0,)),
        jax.jvp(lambda x: g(W, x), (x0,), (x0,)),
    )
    assert_trees_close(jax.jacfwd(f)(W, x0), jax.jacfwd(g)(W, x0))
    assert_trees_close(jax.grad(f, (0, 1))(W, x0), jax.grad(g, (0, 1))(W, x0))
    assert_trees_close(
        jax.hessian(lambda W: f(W, x0))(W), jax.hessian(lambda W: g(W, x0))(W)
    )


def test_iterate_default_keeps_only_the_trajectory():
    # An MLP step of hidden width 256: plain autodiff saves every hidden layer; the
    # default's reverse pass (the transpose of its tangent map) recomputes them, as
    # the custom_vjp does, so both need the same temporary memory.
    keys = jax.random.split(jax.random.key(8), 3)
    W1 = jax.random.normal(keys[0], (256, 16)) / 16
    W2 = jax.random.normal(keys[1], (16, 256)) / 16
    x0 = jax.random.normal(keys[2], (16,))

    def grad(adjoint):
        def f(W1, W2, x0):
            def step(x):
                return x + 0.1 * jnp.tanh(W2 @ jnp.tanh(W1 @ x))

            return jnp.sum(krylovjax.iterate(step, x0, 300, adjoint=adjoint) ** 2)

        return jax.grad(f, (0, 1, 2))

    default = _temp_bytes(grad("custom_jvp"), W1, W2, x0)
    assert default <= _temp_bytes(grad("custom_vjp"), W1, W2, x0)
    assert 3 * default < _temp_bytes(grad("autodiff"), W1, W2, x0)


def test_default_rule_runs_and_is_not_plain_autodiff():
    # The hand-written reverse pass sums in another order than JAX's transposition
    # of the scan: close, but not bitwise equal.
    A = random_matrix(jax.random.key(1), 6, jnp.float64)
    x0 = jnp.ones(6, jnp.float64)
    W = jax.random.normal(jax.random.key(2), (6, 200), jnp.float64)

    def loss(build):
        return lambda A: jnp.sum(build(A, x0, 200) * W)

    ours = jax.grad(loss(krylovjax.krylov))(A)
    plain = jax.grad(loss(_plain))(A)
    assert_trees_close(ours, plain)
    assert not np.array_equal(ours, plain)


@pytest.mark.parametrize("kind", ["dense", "bcoo", "callable"])
@pytest.mark.parametrize("block", [None, 2])
def test_vmap_and_grad_compose_with_the_defaults(kind, block):
    # One operator for a batch of starting vectors: `grad` of the vmapped call runs
    # the reverse pass on the whole batch, `vmap` of `grad` once per member.
    A = random_matrix(jax.random.key(3), 5, jnp.float64)
    like = sparse.BCOO.fromdense(A)
    p = like.data if kind == "bcoo" else A
    shape = (3, 5) if block is None else (3, 5, block)
    x0s = jax.random.normal(jax.random.key(4), shape, jnp.float64)

    def build(adjoint):
        def f(p, x):
            X = krylovjax.krylov(_operator(kind, p, like), x, 70, adjoint=adjoint)
            return jnp.sum(jnp.sin(X))

        return f

    def per_example(f):
        return jax.vmap(jax.grad(f, (0, 1)), (None, 0))(p, x0s)

    def batched(f):
        return jax.grad(lambda p, xs: jax.vmap(f, (None, 0))(p, xs).sum(), (0, 1))(
            p, x0s
        )

    assert_trees_close(per_example(build(None)), per_example(build("autodiff")))
    assert_trees_close(batched(build(None)), batched(build("autodiff")))


def test_layers_support_forward_mode():
    key = jax.random.key(5)
    model = LinearDynamics(3, 20, key=key)
    tangent = jax.tree.map(jnp.ones_like, model)
    _, out = jax.jvp(lambda m: m(), (model,), (tangent,))
    assert out.shape == (20, 3)

    ssm = StateSpaceConv(4, 2, 3, 30, key=key)
    u = jnp.ones((30, 2))
    jac = jax.jacfwd(lambda u: ssm(u))(u)
    assert jac.shape == (30, 3, 30, 2)

    conv = KrylovGraphConv(2, 3, 2, key=key)
    adjacency = sparse.BCOO.fromdense(jnp.eye(4) * 0.5)
    H = jnp.ones((4, 2))
    _, t = jax.jvp(lambda H: conv(adjacency, H), (H,), (H,))
    assert t.shape == (4, 3)


# ------------------------------------------------ memory for every form of loss


LOSSES = (
    "sum",
    "mean",
    "constant_weights",
    "weights_argument",
    "tanh",
    "readout",
    "last",
)


def _loss(kind, X, W):
    if kind == "sum":
        return X.sum()
    if kind == "mean":
        return X.mean()
    if kind == "constant_weights":
        return jnp.sum(X * jnp.arange(X.size, dtype=X.dtype).reshape(X.shape))
    if kind == "weights_argument":
        return jnp.sum(X * W)
    if kind == "tanh":
        return jnp.sum(jnp.tanh(X) ** 2)
    if kind == "readout":
        n = X.shape[0]
        C = jnp.linspace(-1.0, 1.0, 3 * n, dtype=X.dtype).reshape(3, n)
        return jnp.sum(jnp.tensordot(C, X, 1) ** 2)
    return X[:, -1].sum()


def _sparse_like(A, key):
    """`A` as BCOO with about 8 of its entries per row kept, so that the pattern is
    sparse at every size."""
    n = A.shape[0]
    return sparse.BCOO.fromdense(
        jnp.where(jax.random.uniform(key, (n, n)) < 8 / n, A, 0)
    )


def _operator(kind, A, like):
    if kind == "dense":
        return A
    if kind == "bcoo":
        # `A` holds the stored values of `like`'s pattern.
        return sparse.BCOO((A, like.indices), shape=like.shape)
    return lambda x: A @ x


# (n, d, block): vectors of fewer than 64 numbers; a block of 64; a size where a
# dense matrix's gradient adds one step at a time; sizes where it adds blocks of rows.
MEMORY_CASES = [
    (16, 500, None),
    (16, 500, 4),
    (128, 120, None),
    (256, 60, None),
    (256, 60, 4),
]


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("kind", ["dense", "bcoo", "callable"])
@pytest.mark.parametrize("n, d, block", MEMORY_CASES)
def test_grad_memory_at_most_plain_autodiff(loss, kind, n, d, block):
    # `jax.grad` with the defaults needs at most the compiled temporary memory of
    # plain autodiff through a `lax.scan` plus 64 vectors, for every form of loss.
    # Vectors of fewer than 64 numbers (a dense or callable `A` with a small x0)
    # take chunks of 64 steps, whose buffers hold 2 * 64 + n vectors, plus up to 16
    # more that XLA keeps beside the loops (up to 8 measured).
    A = random_matrix(jax.random.key(6), n, jnp.float32)
    like = _sparse_like(A, jax.random.key(7))
    if kind == "bcoo":
        A = like.data
    shape = (n,) if block is None else (n, block)
    x0 = jnp.ones(shape, jnp.float32)
    W = jnp.ones((n, d) if block is None else (n, d, block), jnp.float32)

    def grad(adjoint):
        def f(A, x0, W):
            X = krylovjax.krylov(_operator(kind, A, like), x0, d, adjoint=adjoint)
            return _loss(loss, X, W)

        return jax.grad(f, (0, 1))

    ours = _temp_bytes(grad(None), A, x0, W)
    plain = _temp_bytes(grad("autodiff"), A, x0, W)
    size = int(np.prod(shape))
    small = size < 64 and kind != "bcoo"
    vectors = 2 * 64 + n + 16 if small else 64
    assert ours <= plain + vectors * 4 * size, (
        ours,
        plain,
        (ours - plain) / (4 * size),
    )


# ------------------------------------- the guarantee over random matrix families


def _family(kind, n, rng):
    """A float64 matrix and x0 of one of the families the default must survive."""
    if kind == "growing_mode_avoided":
        # A block-triangular A with a growing block that x0 has no component in.
        A = np.zeros((n, n))
        A[0, 0] = 1.5
        A[1:, 1:] = 0.9 * np.linalg.qr(rng.standard_normal((n - 1, n - 1)))[0]
        A[1:, 0] = rng.standard_normal(n - 1)
        x0 = np.r_[0.0, rng.standard_normal(n - 1)]
    elif kind == "stable_x0_radius_1_5":
        eig = np.r_[1.5, rng.uniform(-0.9, 0.9, n - 1)]
        A = np.diag(eig)
        x0 = np.r_[0.0, rng.standard_normal(n - 1)]
    elif kind == "orthogonal":
        A = np.linalg.qr(rng.standard_normal((n, n)))[0]
        x0 = rng.standard_normal(n)
    else:  # non-normal: a contracting Jordan-like block with a large coupling
        A = np.diag(np.full(n, 0.9)) + np.diag(np.full(n - 1, 3.0), 1)
        x0 = rng.standard_normal(n)
    return A, x0


@settings(max_examples=12, deadline=None)
@example(kind="growing_mode_avoided", n=2, d=1100, seed=0)
@example(kind="stable_x0_radius_1_5", n=3, d=1100, seed=1)
@given(
    kind=st.sampled_from(
        ["growing_mode_avoided", "stable_x0_radius_1_5", "orthogonal", "non_normal"]
    ),
    n=st.integers(2, 6),
    d=st.sampled_from([64, 300, 1100]),
    seed=st.integers(0, 2**16),
)
def test_default_never_worse_than_the_scan(kind, n, d, seed):
    # Values and gradients with the defaults are finite wherever the scan's are, and
    # within 10x the scan's error against a float64 reference.
    A64, x64 = _family(kind, n, np.random.default_rng(seed))
    A, x0 = jnp.asarray(A64, jnp.float32), jnp.asarray(x64, jnp.float32)
    W = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((n, d)))

    def run(A, x0, **kwargs):
        def loss(A, x0):
            out = krylovjax.krylov(A, x0, d, **kwargs)[:, :32]
            # Weighted in float64, also for the float32 runs.
            return jnp.sum(out.astype(W.dtype) * W[:, :32])

        grads = jax.grad(loss, (0, 1))(A, x0)
        return (krylovjax.krylov(A, x0, d, **kwargs), *grads)

    reference = run(jnp.asarray(A64), jnp.asarray(x64), method="scan")
    default, scan = run(A, x0), run(A, x0, method="scan")
    for ours, theirs, ref in zip(default, scan, reference, strict=True):
        ref = np.asarray(ref)
        finite = np.isfinite(np.asarray(theirs))
        assert np.isfinite(np.asarray(ours))[finite].all()
        err = np.abs(np.asarray(ours, np.float64) - ref)[finite].max(initial=0.0)
        err_scan = np.abs(np.asarray(theirs, np.float64) - ref)[finite].max(initial=0.0)
        assert err <= 10 * err_scan + 1e-30


def test_default_at_a_million_steps():
    # The case: a rotation in float32 at d = 10**6; the default's x0
    # gradient stays as accurate as the scan's (doubling's was 300x worse).
    A = jnp.array([[0.6, 0.8], [-0.8, 0.6]], jnp.float32)
    x0 = jnp.array([1.0, 0.0], jnp.float32)
    d = 10**6

    def grad(A, x0, **kwargs):
        return jax.grad(lambda x: krylovjax.krylov(A, x, d, **kwargs).sum())(x0)

    ref = grad(A.astype(jnp.float64), x0.astype(jnp.float64), method="scan")
    err = np.abs(np.asarray(grad(A, x0), np.float64) - ref).max()
    err_scan = np.abs(np.asarray(grad(A, x0, method="scan"), np.float64) - ref).max()
    assert err <= 10 * err_scan


@pytest.mark.parametrize("kind", ["dense", "bcoo"])
def test_grad_of_vmap_over_a_batch_of_operators(kind):
    # A batch of operators (and of starting vectors): `grad` of the vmapped call
    # runs the hand-written reverse pass, vmapped; it must match plain autodiff.
    As = jnp.stack([random_matrix(jax.random.key(i), 5, jnp.float64) for i in range(3)])
    like = sparse.BCOO.fromdense(As[0])
    ps = (
        jnp.stack([sparse.BCOO.fromdense(A).data for A in As]) if kind == "bcoo" else As
    )
    x0s = jax.random.normal(jax.random.key(4), (3, 5), jnp.float64)

    def grads(adjoint):
        def f(p, x):
            X = krylovjax.krylov(_operator(kind, p, like), x, 40, adjoint=adjoint)
            return jnp.sum(jnp.sin(X))

        def total(ps, x0s):
            return jnp.sum(jax.vmap(f)(ps, x0s))

        return jax.grad(total, (0, 1))(ps, x0s)

    assert_trees_close(grads(None), grads("autodiff"))


@pytest.mark.parametrize("kind", ["dense", "bcoo"])
def test_grad_of_vmap_over_operators_keeps_one_stack(kind):
    # With a batch of operators the reverse pass runs vmapped. Its memory beyond
    # plain autodiff is a chunk's buffers per batch member, which do not grow with
    # d: no second copy of the stored vectors (a stack stored with the batch second
    # was copied whole, about d more vectors per member).
    B, n = 3, 256
    As = jnp.broadcast_to(random_matrix(jax.random.key(0), n, jnp.float32), (B, n, n))
    like = _sparse_like(As[0], jax.random.key(1))
    ps = jnp.stack([like.data] * B) if kind == "bcoo" else As
    x0s = jnp.ones((B, n), jnp.float32)

    def extra(d):
        def grad(adjoint):
            def total(ps, x0s):
                def f(p, x):
                    return krylovjax.krylov(
                        _operator(kind, p, like), x, d, adjoint=adjoint
                    )

                return jnp.sum(jax.vmap(f)(ps, x0s))

            return jax.grad(total, (0, 1))

        ours = _temp_bytes(grad(None), ps, x0s)
        return (ours - _temp_bytes(grad("autodiff"), ps, x0s)) / (4 * B * n)

    # Both with chunks of 24 steps (48 and 240 rows).
    short, long = extra(50), extra(242)
    assert long - short <= 2, (short, long)
