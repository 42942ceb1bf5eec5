"""The defaults of `krylov` are safe, lean and differentiable in both modes.

- The default method is the scan: it never returns `nan` where the scan is finite
  (doubling's powers overflow for growing modes that `x0` never touches).
- One default rule serves forward and reverse mode.
- `jax.grad` with the defaults needs at most the compiled temporary memory of plain
  autodiff through a `lax.scan` plus a few chunks of adjoint vectors and one `(n, n)`
  product, for every form of loss.

The data are NumPy arrays, and each test runs its computations in one jitted program
(the compiled-memory checks compile one program per measurement): compiling is what
the tests spend their time on, and `jax.random` and every eager operation compile
programs of their own.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    LOSS_FORMS,
    assert_trees_close,
    numpy_array,
    scalar_loss,
    temp_bytes,
)
from jax.experimental import sparse

import krylovjax
from krylovjax.nn import KrylovGraphConv, LinearDynamics, StateSpaceConv

# ------------------------------------------------------------ the default method


def test_default_is_finite_where_the_scan_is():
    # A mode that grows (1.2^k overflows float32 from k = 487) and an x0 that never
    # touches it: the exact values are [0, 0.5^k]. Doubling forms A^512 = inf and
    # multiplies it by 0.
    A = np.diag(np.array([1.2, 0.5], np.float32))
    x0 = np.array([0.0, 1.0], np.float32)

    @jax.jit
    def run(A, x0):
        return (
            krylovjax.krylov(A, x0, 1024),
            jax.grad(lambda x: krylovjax.krylov(A, x, 1024)[:, :20].sum())(x0),
            krylovjax.krylov(A, x0, 1024, method="doubling"),
        )

    X, grad, doubling = run(A, x0)
    assert np.isfinite(X).all()
    exact = 0.5 ** np.arange(1024, dtype=np.float64)
    np.testing.assert_allclose(X[1], exact, rtol=1e-5, atol=1e-37)
    np.testing.assert_allclose(grad, [sum(1.2**k for k in range(20)), 2.0], rtol=1e-5)
    # Doubling asked for explicitly keeps its documented limit.
    assert np.isnan(doubling).any()


def test_default_keeps_its_accuracy_where_auto_picks_doubling():
    # The scan reproduces a reflection's powers (x0, A x0, x0, ...) almost exactly
    # (2e-8 here); doubling's error grows with d (3e-5 here, with XLA's default
    # optimisations). At this size `method="auto"` picks doubling: the default must
    # not.
    c, s = np.cos(0.4), np.sin(0.4)
    A = np.array([[c, s], [s, -c]], np.float32)
    x0 = np.array([1.0, 0.3], np.float32)
    d = 1024
    assert krylovjax.auto_method(A, x0, d) == "doubling"
    x = np.asarray(x0, np.float64)
    y = np.asarray(A, np.float64) @ x
    exact = np.stack([x if k % 2 == 0 else y for k in range(d)], axis=1)
    X = jax.jit(lambda A, x0: krylovjax.krylov(A, x0, d))(A, x0)
    assert np.abs(np.asarray(X, np.float64) - exact).max() <= 1e-6


# ------------------------------------------------------ forward mode by default


def _matrix(seed, n, scale=0.9):
    """A random float64 NumPy `(n, n)` matrix of spectral radius `scale` (scaled to
    it exactly: the tests run up to 300 steps)."""
    A = numpy_array(seed, (n, n), jnp.float64)
    return A * (scale / np.abs(np.linalg.eigvals(A)).max())


def _plain(A, x0, d):
    return krylovjax.krylov(A, x0, d, adjoint="autodiff")


def test_forward_and_reverse_modes_with_the_defaults():
    # A block in both modes (one chunk) is in
    # test_krylov.py::test_grads_finite_differences_complex_block.
    A = _matrix(0, 4, scale=0.5)
    x0 = numpy_array((0, 1), (4,), jnp.float64)
    d = 70  # more than one chunk of the tangent and reverse passes
    tangents = (np.ones_like(A), np.ones_like(x0))

    def f(build):
        return lambda A, x0: jnp.sum(jnp.sin(build(A, x0, d)))

    def modes(f):
        _, lin = jax.linearize(f, A, x0)
        return (
            jax.jvp(f, (A, x0), tangents),
            jax.jacfwd(f, (0, 1))(A, x0),
            jax.grad(f, (0, 1))(A, x0),
            lin(*tangents),
            jax.hessian(lambda A: f(A, x0))(A),
            jax.jacrev(jax.jacfwd(lambda A: f(A, x0)))(A),
        )

    def reference(f):
        # Plain autodiff's value, gradient (a scalar's Jacobian) and Hessian: every
        # mode above is one of them or a contraction of one.
        return f(A, x0), jax.grad(f, (0, 1))(A, x0), jax.hessian(lambda A: f(A, x0))(A)

    # One program for both: each mode of the default against plain autodiff.
    ours, (value, grad, hess) = jax.jit(
        lambda: (modes(f(krylovjax.krylov)), reference(f(_plain)))
    )()
    jvp, jacfwd, ours_grad, linear, ours_hess, rev_over_fwd = ours
    tangent = np.asarray(
        sum(np.vdot(g, t) for g, t in zip(grad, tangents, strict=True))
    )
    assert_trees_close(jvp, (value, tangent))
    assert_trees_close(linear, tangent)
    assert_trees_close(jacfwd, grad)
    assert_trees_close(ours_grad, grad)
    assert_trees_close(ours_hess, hess)
    assert_trees_close(rev_over_fwd, hess)  # reverse-over-forward is the Hessian


def _sparse_like(A, seed):
    """`A` as BCOO with about 8 of its entries per row kept (at random), so that the
    pattern is sparse at every size; built from NumPy arrays."""
    n = A.shape[0]
    mask = np.random.default_rng(seed).uniform(size=(n, n)) < 8 / n
    return sparse.BCOO((A[mask], np.argwhere(mask).astype(np.int32)), shape=(n, n))


def _full_pattern(n):
    """The indices of every entry of an `(n, n)` matrix, in row-major order (the
    pattern of `BCOO.fromdense` of a matrix with no zeros)."""
    return sparse.BCOO(
        (np.zeros(n * n), np.argwhere(np.ones((n, n))).astype(np.int32)), shape=(n, n)
    )


def _operator(kind, A, like):
    if kind == "dense":
        return A
    if kind == "bcoo":
        # `A` holds the stored values of `like`'s pattern.
        return sparse.BCOO((A, like.indices), shape=like.shape)
    return lambda x: A @ x


# (kind, n, d, block, hvps) for every way the reverse pass splits its steps: a dense
# matrix with chunks of 64 whose last one overlaps the one above (vectors of fewer
# than 64 numbers, 299 rows), for a vector (the rank-one gradient of each step) and
# a block (the block's transpose); a dense gradient added one step at a time
# (n = 70); blocks of rows of the gradient with chunks of 24 (n = 256), for a vector
# and a block; BCOO's chunks of 8 steps; a callable's budgeted chunks (one batched
# VJP each). `hvps`: also the second derivatives of the reverse pass (BCOO's run
# the same overlapping chunks as a dense matrix's with small vectors, whose
# gradient is the generic one of the one-step chunks at n = 70).
CHUNKING_CASES = [
    ("dense", 8, 300, None, False),
    ("dense", 8, 300, 2, False),
    ("dense", 70, 40, None, True),
    ("dense", 256, 100, None, False),
    ("dense", 256, 100, 3, False),
    ("bcoo", 8, 300, None, True),
    ("callable", 8, 300, 2, False),
]


@pytest.mark.parametrize("kind, n, d, block, hvps", CHUNKING_CASES)
def test_every_chunking_matches_autodiff(kind, n, d, block, hvps):
    A = _matrix(1, n, scale=0.95)
    like = _sparse_like(A, seed=2) if kind == "bcoo" else None
    if kind == "bcoo":
        A = np.asarray(like.data)
    shape = (n,) if block is None else (n, block)
    x0 = numpy_array(3, shape, jnp.float64)
    W = numpy_array(4, (n, d, *shape[1:]), jnp.float64)

    def loss(adjoint):
        def f(A, x0):
            X = krylovjax.krylov(_operator(kind, A, like), x0, d, adjoint=adjoint)
            return jnp.sum(jnp.tanh(X) * W)

        return f

    ours, plain = loss(None), loss("autodiff")

    # Second derivatives run the reverse pass's own derivatives: forward over
    # reverse and reverse over reverse, as Hessian-vector products (both are H V).
    V = np.cos(np.arange(A.size, dtype=A.dtype)).reshape(A.shape)

    def hvp(f, mode):
        g = jax.grad(f)
        if mode == "forward":
            return jax.jvp(lambda A: g(A, x0), (A,), (V,))[1]
        return jax.grad(lambda A: jnp.vdot(g(A, x0), V))(A)

    @jax.jit
    def grads(A, x0):
        # The default with both arguments and with x0 alone (the operator is not
        # perturbed), plain autodiff and, with the second derivatives, the
        # custom_vjp (its reverse pass runs the same chunks).
        second = None
        if hvps:
            second = (
                jax.grad(loss("custom_vjp"), (0, 1))(A, x0),
                hvp(ours, "forward"),
                hvp(ours, "reverse"),
                hvp(plain, "forward"),
            )
        return (
            jax.grad(ours, (0, 1))(A, x0),
            jax.grad(ours, 1)(A, x0),
            jax.grad(plain, (0, 1))(A, x0),
            second,
        )

    both, x0_only, want, second = grads(A, x0)
    assert_trees_close(both, want)
    assert_trees_close(x0_only, want[1])
    if hvps:
        custom_vjp, forward, reverse, hv = second
        assert_trees_close(custom_vjp, want)
        assert_trees_close(forward, hv)
        assert_trees_close(reverse, hv)


def test_linear_transpose_with_the_defaults():
    # krylov and iterate are linear in x0 for a fixed linear step: JAX can transpose
    # them, which runs the hand-written reverse pass.
    A = _matrix(9, 4)
    x0 = np.ones(4, np.float64)
    ct = numpy_array(10, (4, 70), jnp.float64)

    @jax.jit
    def transposes(ct):
        want = jax.vjp(lambda x: _plain(A, x, 70), x0)[1](ct)
        got = jax.linear_transpose(lambda x: krylovjax.krylov(A, x, 70), x0)(ct)
        step = lambda v: A @ v  # noqa: E731
        it = jax.linear_transpose(lambda x: krylovjax.iterate(step, x, 70), x0)(ct.T)
        return want, got, it

    want, got, it = transposes(ct)
    assert_trees_close(got, want)
    assert_trees_close(it, want)


def test_iterate_forward_and_reverse_modes_with_the_defaults():
    W = _matrix(7, 4, scale=0.5)
    x0 = (np.ones(4, np.float64), np.array(1.0, np.float64))

    def f(W, x0, adjoint="custom_jvp"):
        def step(s):
            return jnp.tanh(W @ s[0]), 0.9 * s[1] + s[0].sum()

        xs = krylovjax.iterate(step, x0, 30, adjoint=adjoint)
        return jnp.sum(xs[0] ** 2) + jnp.sum(jnp.sin(xs[1]))

    def modes(f):
        return (
            jax.jvp(lambda x: f(W, x), (x0,), (x0,)),
            jax.jacfwd(f)(W, x0),
            jax.grad(f, (0, 1))(W, x0),
            jax.hessian(lambda W: f(W, x0))(W),
        )

    ours, plain = jax.jit(
        lambda: (modes(f), modes(lambda W, x0: f(W, x0, adjoint="autodiff")))
    )()
    assert_trees_close(ours, plain)


def test_default_rule_runs_and_is_not_plain_autodiff():
    # The hand-written reverse pass sums in another order than JAX's transposition
    # of the scan: close, but not bitwise equal.
    A = _matrix(1, 6)
    x0 = np.ones(6, np.float64)
    W = numpy_array(2, (6, 200), jnp.float64)

    def loss(build):
        return lambda A: jnp.sum(build(A, x0, 200) * W)

    ours, plain = jax.jit(
        lambda A: (jax.grad(loss(krylovjax.krylov))(A), jax.grad(loss(_plain))(A))
    )(A)
    assert_trees_close(ours, plain)
    assert not np.array_equal(ours, plain)


# One operator for a batch of starting vectors: each kind, a dense matrix with a
# vector and a block (BCOO with a block is in test_sparse.py).
VMAP_CASES = [("dense", None), ("dense", 2), ("bcoo", None), ("callable", 2)]


def test_vmap_and_grad_compose_with_the_defaults():
    """`grad` of the vmapped call runs the reverse pass on the whole batch, `vmap` of
    `grad` once per member: both equal plain autodiff's, for every case of
    `VMAP_CASES` (kind, block)."""
    A = _matrix(3, 5)
    like = _full_pattern(5)  # BCOO's stored values: every entry of `A`
    args = [
        (
            A.reshape(-1) if kind == "bcoo" else A,
            numpy_array(4, (3, 5) if block is None else (3, 5, block), jnp.float64),
        )
        for kind, block in VMAP_CASES
    ]

    def both(kind, p, x0s, adjoint):
        def f(p, x):
            X = krylovjax.krylov(_operator(kind, p, like), x, 70, adjoint=adjoint)
            return jnp.sum(jnp.sin(X))

        per_example = jax.vmap(jax.grad(f, (0, 1)), (None, 0))(p, x0s)
        batched = jax.grad(lambda p, xs: jax.vmap(f, (None, 0))(p, xs).sum(), (0, 1))(
            p, x0s
        )
        return per_example, batched

    @jax.jit
    def run(args):
        return [
            (both(kind, p, x0s, None), both(kind, p, x0s, "autodiff"))
            for (kind, _), (p, x0s) in zip(VMAP_CASES, args, strict=True)
        ]

    for case, (ours, plain) in zip(VMAP_CASES, run(args), strict=True):
        assert_trees_close(ours, plain, err_msg=str(case))


def test_layers_support_forward_mode():
    # The layers are made inside the program, with everything else it uses.
    diagonal = np.stack([np.arange(4), np.arange(4)], axis=1).astype(np.int32)
    u = np.ones((30, 2))

    @jax.jit
    def forward_modes():
        key = jax.random.key(5)
        model = LinearDynamics(3, 20, key=key)
        ssm = StateSpaceConv(4, 2, 3, 30, key=key)
        conv = KrylovGraphConv(2, 3, 2, key=key)
        adjacency = sparse.BCOO((jnp.full(4, 0.5), diagonal), shape=(4, 4))
        H = jnp.ones((4, 2))
        tangent = jax.tree.map(jnp.ones_like, model)

        def shifted(eps):
            return jax.tree.map(lambda p, t: p + eps * t, model, tangent)()

        return (
            jax.jvp(lambda m: m(), (model,), (tangent,))[1],
            (shifted(1e-6) - shifted(-1e-6)) / 2e-6,
            jax.jacfwd(lambda u: ssm(u))(u),
            ssm(u) - ssm(jnp.zeros_like(u)),
            jax.jvp(lambda H: conv(adjacency, H), (H,), (H,))[1],
            conv(adjacency, H) - conv(adjacency, jnp.zeros_like(H)),
        )

    out, difference, jac, ssm_linear, t, conv_linear = forward_modes()
    assert out.shape == (20, 3)
    np.testing.assert_allclose(out, difference, rtol=1e-6, atol=1e-8)
    # The sequence map and the graph filter are linear in `u` and `H`.
    assert jac.shape == (30, 3, 30, 2)
    np.testing.assert_allclose(
        np.einsum("tcsi,si->tc", jac, u), ssm_linear, rtol=1e-10, atol=1e-12
    )
    assert t.shape == (4, 3)
    np.testing.assert_allclose(t, conv_linear, rtol=1e-10, atol=1e-12)


# ------------------------------------------------ memory for every form of loss


# (loss, kind, n, d, block), the full grid in benchmarks/bench_memory.py: every
# operator kind at every size, the loss forms in turn (each at least twice). Sizes:
# vectors of fewer than 64 numbers; a block of 64; a size where a dense matrix's
# gradient adds one step at a time; sizes where it adds blocks of rows.
MEMORY_SIZES = [
    (16, 500, None),
    (16, 500, 4),
    (128, 120, None),
    (256, 60, None),
    (256, 60, 4),
]
MEMORY_CASES = [
    (LOSS_FORMS[i % len(LOSS_FORMS)], kind, *size)
    for i, (kind, size) in enumerate(
        (kind, size) for kind in ("dense", "bcoo", "callable") for size in MEMORY_SIZES
    )
]


def _shape(shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _pattern(n, seed):
    """A BCOO pattern of `(n, n)` with about 8 stored entries per row (at least one),
    built in NumPy: its stored values are an argument of the programs."""
    rng = np.random.default_rng(seed)
    mask = rng.uniform(size=(n, n)) < 8 / n
    mask[np.arange(n), rng.integers(0, n, n)] = True
    indices = np.argwhere(mask).astype(np.int32)
    data = np.zeros(len(indices), np.float32)
    return sparse.BCOO((data, indices), shape=(n, n))


def memory_excess(loss, kind, n, d, block):
    """`(ours, plain, bound)`: the compiled temporary bytes of `jax.grad` with the
    defaults and with plain autodiff through the scan, and the bound on `ours`.

    The bound is plain autodiff's plus 64 vectors. Vectors of fewer than 64 numbers
    (a dense or callable `A` with a small x0) take chunks of 64 steps, whose buffers
    hold 2 * 64 + n vectors, plus up to 16 more that XLA keeps beside the loops (up
    to 8 measured).
    """
    # Shapes only: the programs are compiled, never run. BCOO's pattern (about 8
    # entries per row) is a constant of the program, as a user's would be.
    like = _pattern(n, seed=7)
    A = _shape((like.nse,) if kind == "bcoo" else (n, n))
    shape = (n,) if block is None else (n, block)
    x0 = _shape(shape)
    W = _shape((n, d) if block is None else (n, d, block))

    def grad(adjoint):
        def f(A, x0, W):
            X = krylovjax.krylov(_operator(kind, A, like), x0, d, adjoint=adjoint)
            return scalar_loss(X, loss, W)

        return jax.grad(f, (0, 1))

    ours = temp_bytes(grad(None), A, x0, W)
    plain = temp_bytes(grad("autodiff"), A, x0, W)
    size = int(np.prod(shape))
    small = size < 64 and kind != "bcoo"
    vectors = 2 * 64 + n + 16 if small else 64
    return ours, plain, plain + vectors * 4 * size


@pytest.mark.parametrize("loss, kind, n, d, block", MEMORY_CASES)
def test_grad_memory_at_most_plain_autodiff(loss, kind, n, d, block):
    # `jax.grad` with the defaults needs at most the compiled temporary memory of
    # plain autodiff through a `lax.scan` plus 64 vectors, for every form of loss.
    ours, plain, bound = memory_excess(loss, kind, n, d, block)
    size = n if block is None else n * block
    assert ours <= bound, (ours, plain, (ours - plain) / (4 * size))


def test_default_at_a_million_steps():
    # A rotation in float32 at d = 10**6, where `method="auto"` picks doubling: the
    # default's x0 gradient keeps the scan's accuracy against the closed form
    # sum_k (A^T)^k 1 = (I - A^T)^(-1) (I - (A^T)^d) 1 of the float32 matrix. The
    # scan's error is 1.8e-3, doubling's (what `auto` runs) 3.5e-2.
    A = np.array([[0.6, 0.8], [-0.8, 0.6]], np.float32)
    x0 = np.array([1.0, 0.0], np.float32)
    d = 10**6
    assert krylovjax.auto_method(A, x0, d) == "doubling"
    At = np.asarray(A, np.float64).T
    power = np.linalg.matrix_power(At, d)
    exact = np.linalg.solve(np.eye(2) - At, (np.eye(2) - power) @ np.ones(2))
    grad = jax.jit(jax.grad(lambda x: krylovjax.krylov(A, x, d).sum()))(x0)
    assert np.abs(np.asarray(grad, np.float64) - exact).max() <= 6e-3


def test_grad_of_vmap_over_a_batch_of_operators():
    """A batch of operators (and of starting vectors), dense and BCOO: `grad` of the
    vmapped call runs the hand-written reverse pass, vmapped; it must match plain
    autodiff."""
    As = np.stack([_matrix(i, 5) for i in range(3)])
    like = _full_pattern(5)  # BCOO's stored values: every entry of each matrix
    x0s = numpy_array(4, (3, 5), jnp.float64)
    kinds = ["dense", "bcoo"]

    def grads(kind, ps, x0s, adjoint):
        def f(p, x):
            X = krylovjax.krylov(_operator(kind, p, like), x, 40, adjoint=adjoint)
            return jnp.sum(jnp.sin(X))

        def total(ps, x0s):
            return jnp.sum(jax.vmap(f)(ps, x0s))

        return jax.grad(total, (0, 1))(ps, x0s)

    @jax.jit
    def run(As, x0s):
        out = []
        for kind in kinds:
            ps = As.reshape(3, -1) if kind == "bcoo" else As
            out.append((grads(kind, ps, x0s, None), grads(kind, ps, x0s, "autodiff")))
        return out

    for kind, (ours, plain) in zip(kinds, run(As, x0s), strict=True):
        assert_trees_close(ours, plain, err_msg=kind)


@pytest.mark.parametrize("kind", ["dense", "bcoo"])
def test_grad_of_vmap_over_operators_keeps_one_stack(kind):
    # With a batch of operators the reverse pass runs vmapped. Its memory beyond
    # plain autodiff is a chunk's buffers per batch member, which do not grow with
    # d: no second copy of the stored vectors (a stack stored with the batch second
    # was copied whole, about d more vectors per member).
    B, n = 3, 256
    like = _pattern(n, seed=1)
    ps = _shape((B, like.nse) if kind == "bcoo" else (B, n, n))
    x0s = _shape((B, n))

    def extra(d):
        def grad(adjoint):
            def total(ps, x0s):
                def f(p, x):
                    return krylovjax.krylov(
                        _operator(kind, p, like), x, d, adjoint=adjoint
                    )

                return jnp.sum(jax.vmap(f)(ps, x0s))

            return jax.grad(total, (0, 1))

        ours = temp_bytes(grad(None), ps, x0s)
        return (ours - temp_bytes(grad("autodiff"), ps, x0s)) / (4 * B * n)

    # Both with chunks of 24 steps (48 and 240 rows).
    short, long = extra(50), extra(242)
    assert long - short <= 2, (short, long)
