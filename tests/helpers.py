"""Reference implementations and problem factories shared by the tests.

The references are written independently of the library: a plain Python loop and a
plain `lax.scan`, both differentiated by JAX's own rules.
"""

import contextlib
import itertools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jaxtyping
import numpy as np
import optax
import pytest
from jax import lax
from jax.experimental import sparse
from jax.test_util import check_jvp, check_vjp

import krylovjax

METHODS = ("scan", "doubling")
ADJOINTS = ("custom_vjp", "custom_jvp", "autodiff")
LAYOUTS = ("columns", "rows")
DTYPES = (jnp.float32, jnp.float64, jnp.complex64, jnp.complex128)
DECOMPOSITIONS = ("arnoldi", "lanczos")
MATRIX_KINDS = ("dense", "bcoo")
CALLABLE_KINDS = ("closure", "module", "method")
KINDS = MATRIX_KINDS + CALLABLE_KINDS


def supported(method="scan", kind="dense", adjoint="custom_vjp", **_):
    """Whether `krylov` accepts this combination (doubling: no custom_jvp)."""
    del kind
    return method != "doubling" or adjoint != "custom_jvp"


def grid(**axes):
    """`pytest.mark.parametrize` over the product of `axes`, supported cases only.

    Unsupported combinations (see `supported`) are not generated at all; the
    errors they raise are tested in test_errors.py.
    """
    names = list(axes)
    rows = [
        row
        for row in itertools.product(*axes.values())
        if supported(**dict(zip(names, row, strict=True)))
    ]
    if len(names) == 1:
        rows = [row[0] for row in rows]
    return pytest.mark.parametrize(",".join(names), rows)


def tol(dtype):
    """(rtol, atol) for comparing two computations in `dtype`."""
    if jnp.finfo(dtype).bits <= 32:
        return {"rtol": 1e-4, "atol": 1e-5}
    return {"rtol": 1e-10, "atol": 1e-12}


def random_array(key, shape, dtype):
    """Standard normal entries in `dtype` (real and imaginary parts for complex)."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        real = jnp.finfo(dtype).dtype
        kr, ki = jr.split(key)
        re = jr.normal(kr, shape, real)
        im = jr.normal(ki, shape, real)
        # Scaled in complex128, then rounded: explicitly what `(re + 1j * im) /
        # np.sqrt(2)` promoted to, so the draws are the same bits as ever.
        z = jax.lax.complex(re, im).astype(jnp.complex128)
        return (z / jnp.asarray(np.sqrt(2), jnp.complex128)).astype(dtype)
    return jr.normal(key, shape, dtype)


def _scaled(x, scale):
    # A NumPy float64 scalar is not weakly typed and would promote float32 to
    # float64; multiply by a Python float and keep the dtype explicit.
    return (float(scale) * x).astype(x.dtype)


def random_matrix(key, n, dtype, scale=0.9):
    """A random (n, n) matrix of spectral radius around `scale`."""
    return _scaled(random_array(key, (n, n), dtype), scale / np.sqrt(n))


def spd(n=10, seed=0, low=0.5, high=4.0, dtype=np.float64):
    """A NumPy symmetric positive definite `(n, n)` matrix (Hermitian for a complex
    `dtype`) with eigenvalues evenly spread over `[low, high]` and random
    eigenvectors."""
    rng = np.random.default_rng(seed)
    Z = rng.normal(size=(n, n))
    if np.issubdtype(dtype, np.complexfloating):
        Z = Z + 1j * rng.normal(size=(n, n))
    Q, _ = np.linalg.qr(Z)
    S = (Q * np.linspace(low, high, n)) @ Q.conj().T
    return (S + S.conj().T) / 2


def x0_shape(n, block):
    return (n,) if block is None else (n, block)


# ----------------------------------------------------------------- references


def krylov_loop(mv, x0, d, layout="columns"):
    """The Krylov vectors x0, A x0, ... built by a plain Python loop."""
    xs = [x0]
    for _ in range(d - 1):
        xs.append(mv(xs[-1]))
    return to_layout(jnp.stack(xs), layout)


def krylov_scan_reference(mv, x0, d, layout="columns"):
    """The Krylov vectors from a plain `lax.scan` that carries the last vector."""

    def body(x, _):
        return mv(x), x

    _, xs = lax.scan(body, x0, None, length=d)
    return to_layout(xs, layout)


def iterate_scan_reference(step, x0, d):
    """Trajectory of a pytree state under `step`, stacked on a new leading axis."""

    def body(x, _):
        return step(x), x

    _, xs = lax.scan(body, x0, None, length=d)
    return xs


def to_layout(rows, layout):
    """(d, n, ...) -> the library's layout."""
    return rows if layout == "rows" else jnp.moveaxis(rows, 0, 1)


def as_mv(A):
    """A plain matvec for any accepted operator, without the library."""
    if isinstance(A, jax.Array | sparse.BCOO | np.ndarray):
        return lambda x: A @ x
    return A


# ------------------------------------------------------------- operator kinds


class Linear(eqx.Module):
    """x -> W x as an Equinox module."""

    weight: jax.Array

    def __call__(self, x):
        return self.weight @ x


class MatVec(eqx.Module):
    """A module whose `.mv` bound method is the operator."""

    weight: jax.Array
    shift: jax.Array

    def mv(self, x):
        return self.weight @ x + self.shift * x


def sparse_mask(n):
    """A fixed sparsity pattern: the diagonal and two off-diagonals."""
    i = np.arange(n)
    mask = np.zeros((n, n), bool)
    mask[i, i] = True
    mask[i, (i + 1) % n] = True
    mask[i, (i + 3) % n] = True
    return mask


def make_operator(kind, A):
    """Return `(params, build)` so that `build(params)` is an operator of `kind`.

    Gradients with respect to `params` are the gradients that must reach every array
    the operator holds. `build(params)` equals the dense matrix `A` (masked for BCOO;
    plus a shift for the bound method).
    """
    n = A.shape[0]
    if kind == "dense":
        return A, lambda p: p
    if kind == "bcoo":
        B = sparse.BCOO.fromdense(jnp.where(sparse_mask(n), A, 0))
        indices, shape = B.indices, B.shape
        return B.data, lambda data: sparse.BCOO((data, indices), shape=shape)
    if kind == "closure":
        return A, lambda p: lambda x: p @ x
    if kind == "module":
        return Linear(A), lambda m: m
    if kind == "method":
        shift = jnp.asarray(0.25, A.dtype)
        return MatVec(A, shift), lambda m: m.mv
    raise ValueError(kind)


def full_operator(kind, A):
    """`(params, build)` as `make_operator` gives, for `kind` in dense, bcoo,
    closure, module, but with every entry of `A` stored in the BCOO matrix (zeros
    too, so the pattern is symmetric): `build(params)`'s matrix is all of `A`."""
    A = jnp.asarray(A)
    if kind == "bcoo":
        B = sparse.BCOO.fromdense(A, nse=A.size)
        indices, shape = B.indices, B.shape
        return B.data, lambda data: sparse.BCOO((data, indices), shape=shape)
    return make_operator(kind, A)


def dense_of(kind, params):
    """The dense matrix that `make_operator(kind, ...)`'s operator represents."""
    if kind in ("dense", "closure"):
        return params
    if kind == "module":
        return params.weight
    if kind == "method":
        return params.weight + params.shift * jnp.eye(params.weight.shape[0])
    raise ValueError(kind)


# ------------------------------------------------------------- iterate steps


class MLP(eqx.Module):
    """x -> tanh(W2 tanh(W1 x + b1) + b2): a nonlinear step with weight leaves."""

    w1: jax.Array
    b1: jax.Array
    w2: jax.Array
    b2: jax.Array

    def __init__(self, key, state, width, dtype=jnp.float64):
        k1, k2, k3, k4 = jr.split(key, 4)
        self.w1 = _scaled(jr.normal(k1, (width, state), dtype), 1 / np.sqrt(state))
        self.b1 = _scaled(jr.normal(k2, (width,), dtype), 0.1)
        self.w2 = _scaled(jr.normal(k3, (state, width), dtype), 1 / np.sqrt(width))
        self.b2 = _scaled(jr.normal(k4, (state,), dtype), 0.1)

    def __call__(self, x):
        return jnp.tanh(self.w2 @ jnp.tanh(self.w1 @ x + self.b1) + self.b2)


def random_like(key, tree):
    """A random pytree with the structure, shapes and dtypes of `tree`."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jr.split(key, len(leaves))
    new = [random_array(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, new)


def assert_trees_close(a, b, **kwargs):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, (ta, tb)
    for x, y in zip(la, lb, strict=True):
        assert x.shape == y.shape, (x.shape, y.shape)
        assert x.dtype == y.dtype, (x.dtype, y.dtype)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kwargs)


def random_problem(dtype, block=None, n=5, seed=0):
    """A random `(n, n)` matrix of spectral radius about 0.9 and an `x0` of shape
    `(n,)` or `(n, block)`, in `dtype`."""
    ka, kx = jr.split(jr.key(seed))
    return random_matrix(ka, n, dtype), random_array(kx, x0_shape(n, block), dtype)


def vjps(fs, args, key):
    """Outputs and VJPs of each of `fs` at `args` with one random cotangent, in one
    jitted program."""
    out = jax.eval_shape(fs[0], *args)
    ct = random_like(key, out)

    @jax.jit
    def run(args, ct):
        results = []
        for f in fs:
            out, vjp = jax.vjp(f, *args)
            results.append((out, vjp(ct)))
        return results

    return run(args, ct)


def value_vjp_jvp(f, primals, tangents, cotangents):
    """`(f(*primals), its VJP of cotangents, its JVP along tangents)`, to be called
    inside a jitted program (the form `check_finite_differences` takes).

    Both from one linearisation (the VJP is its transpose, as `jax.vjp` computes
    it): one copy of the forward pass and of the tangent map, where `jax.vjp` and
    `jax.jvp` would compile two of each."""
    out, linear = jax.linearize(f, *primals)
    vjp = jax.linear_transpose(linear, *primals)(cotangents)
    return out, vjp, linear(*tangents)


def check_finite_differences(f, derivatives, args, **options):
    """`jax.test_util.check_grads(f, args, order=1, modes=("fwd", "rev"), **options)`
    (`atol`, `rtol`, `eps`) with every evaluation taken from a program that the test
    has compiled already.

    `derivatives(args, tangents, cotangents)` returns `(f(*args), vjp, jvp)`: the
    VJP of `cotangents` and the JVP along `tangents`, typically one jitted program
    that serves the test's other checks too. `check_jvp` and `check_vjp` call it
    with their own random directions, and for the finite differences at `args`
    moved along them, all of the shapes of `args` and of `f`'s output: nothing new
    is compiled (`f` is only traced, for those shapes). The same directions, step
    and tolerances as `check_grads`. The arrays of `args` must not be weakly typed
    (`jnp.asarray(0.8, jnp.float64)`, not `jnp.asarray(0.8)`): the directions are
    not, and the program would be compiled again for them.
    """
    args = tuple(args)
    weak = [x for x in jax.tree.leaves(args) if jax.typeof(x).weak_type]
    assert not weak, f"weakly typed arguments compile the program again: {weak}"
    zero_tangents = jax.tree.map(jnp.zeros_like, args)
    zero_cotangents = jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(f, *args)
    )

    def forward(*primals):
        return derivatives(primals, zero_tangents, zero_cotangents)[0]

    def f_jvp(primals, tangents):
        out, _, jvp = derivatives(tuple(primals), tuple(tangents), zero_cotangents)
        return out, jvp

    def f_vjp(*primals):
        return forward(*primals), lambda ct: derivatives(primals, zero_tangents, ct)[1]

    check_jvp(forward, f_jvp, args, **options)
    check_vjp(forward, f_vjp, args, **options)


# ------------------------------------------------------ losses and memory

# The forms of scalar loss that the gradient tests differentiate (`scalar_loss`).
LOSS_FORMS = (
    "sum",
    "mean",
    "constant_weights",
    "weights_argument",
    "tanh",
    "readout",
    "last",
)


def scalar_loss(out, form="sin", weights=None):
    """A scalar loss of `out` (an array, or a pytree summed over its leaves).

    `form` is one of `LOSS_FORMS` (on a Krylov matrix `(n, d, ...)`: its sum, mean,
    a product with constant weights or with `weights`, `tanh` squared, a readout
    `C X` squared, the last column), `"sin"` (the sum of `sin`, nonlinear so that
    second derivatives do not vanish) or `"weighted_squares"` (`weights * out**2`).
    """
    if not isinstance(out, jax.Array):
        leaves = jax.tree_util.tree_leaves(out)
        return sum(scalar_loss(x, form, weights) for x in leaves)
    X, W = out, weights
    if form == "sin":
        return jnp.sum(jnp.sin(X))
    if form == "weighted_squares":
        return jnp.sum(W * X**2)
    if form == "sum":
        return X.sum()
    if form == "mean":
        return X.mean()
    if form == "constant_weights":
        return jnp.sum(X * jnp.arange(X.size, dtype=X.dtype).reshape(X.shape))
    if form == "weights_argument":
        return jnp.sum(X * W)
    if form == "tanh":
        return jnp.sum(jnp.tanh(X) ** 2)
    if form == "readout":
        n = X.shape[0]
        C = jnp.linspace(-1.0, 1.0, 3 * n, dtype=X.dtype).reshape(3, n)
        return jnp.sum(jnp.tensordot(C, X, 1) ** 2)
    if form == "last":
        return X[:, -1].sum()
    raise ValueError(form)


def temp_bytes(fn, *args):
    """XLA's compiled temporary memory of `jax.jit(fn)(*args)`, in bytes (skips the
    test where the backend has no memory analysis). `args` may be arrays or
    `jax.ShapeDtypeStruct`s: nothing runs."""
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    if stats is None:
        pytest.skip("memory_analysis() returns None on this backend")
    return stats.temp_size_in_bytes


# ------------------------------------------------------- runtime type checking

# The suite runs with jaxtyping's import hook on the package
# (`--jaxtyping-packages=krylovjax,beartype.beartype` in pyproject's addopts): every
# function and method of krylovjax checks its arguments and return value against its
# annotations, dtypes and shapes included. `python -m pytest --jaxtyping-packages=`
# (an empty list) runs without it.
RUNTIME_CHECKED = hasattr(krylovjax.krylov, "__wrapped__")


def unchecked(fn):
    """`fn` for a call whose arguments lie outside its annotations on purpose.

    krylovjax validates its arguments itself, for the usual caller who runs no type
    checker, and the error tests assert those messages (`krylov(method=...)` must be
    one of ..., a float `d`, an integer `x0`, a list where an array belongs). Under
    the runtime checker such a call is rejected before krylovjax's own check runs.
    Three ways to keep both tested were weighed:

    - `inspect.unwrap(fn)`: strips the wrapper of a plain function, but not the
      `__init__` that jaxtyping wraps on an Equinox module class, nor a module's
      `__call__`;
    - a marker that skips these tests under the hook: they would then assert
      nothing in the normal run;
    - this helper, chosen: it makes the call twice. Under the hook, first as it
      stands, asserting that the checker rejects it with a `TypeCheckError` about
      the parameters of `fn` itself (so the input really is outside the annotation,
      and an annotation narrower than what krylovjax accepts fails here rather than
      being hidden); then with jaxtyping's checks switched off for the duration of
      the call (`jaxtyping.config`'s `jaxtyping_disable`, which every checked
      wrapper reads when called), returning or raising what krylovjax itself does.
      Without the hook only the second call is made.

    So every such test asserts krylovjax's own message in both runs, and the hooked
    run also asserts that the annotation rejects the input. `fn` may be a function,
    a bound method, an Equinox module class (the call constructs it) or a module
    instance (the call is its `__call__`). Use it only for arguments outside the
    annotations: for one inside them the first assertion fails.
    """

    def call(*args, **kwargs):
        if RUNTIME_CHECKED:
            where = re.escape(f"checking the parameters of {_checked_name(fn)}.")
            with pytest.raises(jaxtyping.TypeCheckError, match=where):
                fn(*args, **kwargs)
        with _checks_off():
            return fn(*args, **kwargs)

    return call


def _checked_name(fn):
    """The name under which jaxtyping reports a failed check of `fn`'s arguments."""
    if isinstance(fn, type):
        return f"{fn.__module__}.{fn.__qualname__}.__init__"
    if hasattr(fn, "__qualname__"):
        return f"{fn.__module__}.{fn.__qualname__}"
    return f"{type(fn).__module__}.{type(fn).__qualname__}.__call__"


@contextlib.contextmanager
def _checks_off():
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)


# ------------------------------------------------ orthogonal decompositions


def decomposition_problem(kind, dtype, n=6, hermitian=False, seed=0):
    """`(params, build, dense, x0)` for `arnoldi` and `lanczos`.

    `build(params)` is an operator of `kind` whose matrix is `dense(params)`, of
    spectral radius about 1 (Hermitian if `hermitian`; a BCOO matrix then has a
    symmetric pattern), and `x0` a random `(n,)` vector, all in `dtype`.
    """
    ka, kx = jr.split(jr.key(seed))
    A = random_array(ka, (n, n), dtype)
    if hermitian:
        A = (A + A.conj().T) / 2
    A = _scaled(A, 1 / np.sqrt(n))
    x0 = random_array(kx, (n,), dtype)
    if kind == "bcoo":
        mask = sparse_mask(n)
        B = sparse.BCOO.fromdense(jnp.where(mask | mask.T, A, 0))
        indices, shape = B.indices, B.shape

        def build(data):
            return sparse.BCOO((data, indices), shape=shape)

        return B.data, build, lambda data: build(data).todense(), x0
    params, build = make_operator(kind, A)
    return params, build, lambda p: dense_of(kind, p), x0


def decompose(method, A, x0, d, **options):
    """`krylovjax.arnoldi` or `krylovjax.lanczos` (`method`, one of
    `DECOMPOSITIONS`)."""
    return getattr(krylovjax, method)(A, x0, d, **options)


def decomposition_fn(method, d, build=lambda p: p, **options):
    """`(params, x0) ->` the arrays of `decompose(method, build(params), x0, d,
    **options)` as a tuple, in field order: Arnoldi's `(basis, hessenberg,
    residual, norm)`, Lanczos's `(basis, diagonal, off_diagonal, residual,
    norm)`."""

    def f(params, x0):
        return tuple(
            jax.tree.leaves(decompose(method, build(params), x0, d, **options))
        )

    return f


def small_matrix(dec):
    """The `(d, d)` matrix of a decomposition: Arnoldi's `H`, Lanczos's `T`."""
    return dec.hessenberg if isinstance(dec, krylovjax.Arnoldi) else dec.matrix()


def decomposition_numpy(method, A, x0, d, reorthogonalize=True):
    """The NumPy reference (`arnoldi_numpy`, `lanczos_numpy`), its arrays in the
    order of `decomposition_fn`."""
    reference = arnoldi_numpy if method == "arnoldi" else lanczos_numpy
    return reference(A, x0, d, reorthogonalize)


def arnoldi_numpy(A, x0, d, reorthogonalize=True):
    """Arnoldi's method by a NumPy loop, in float64 or complex128: `(Q, H, r,
    norm)` with `Q` `(n, d)`. Classical Gram-Schmidt against the vectors so far,
    twice or once; no breakdown handling."""
    A, x0 = np.asarray(A), np.asarray(x0)
    dtype = np.result_type(A, x0, np.float64)
    n = x0.shape[0]
    Q, H = np.zeros((n, d), dtype), np.zeros((d, d), dtype)
    norm = np.linalg.norm(x0)
    Q[:, 0] = x0 / norm
    for k in range(d):
        w = A @ Q[:, k]
        for _ in range(2 if reorthogonalize else 1):
            c = Q[:, : k + 1].conj().T @ w
            w = w - Q[:, : k + 1] @ c
            H[: k + 1, k] += c
        if k + 1 < d:
            H[k + 1, k] = np.linalg.norm(w)
            Q[:, k + 1] = w / H[k + 1, k]
    return Q, H, w, norm


def lanczos_numpy(A, x0, d, reorthogonalize=True):
    """Lanczos's method by a NumPy loop, in float64 or complex128: `(Q, alpha,
    beta, r, norm)`. The three-term recurrence, then (if `reorthogonalize`) one
    classical Gram-Schmidt pass against every vector so far; no breakdown
    handling."""
    A, x0 = np.asarray(A), np.asarray(x0)
    dtype = np.result_type(A, x0, np.float64)
    n = x0.shape[0]
    Q = np.zeros((n, d), dtype)
    alpha, beta = np.zeros(d), np.zeros(max(d - 1, 0))
    norm = np.linalg.norm(x0)
    Q[:, 0] = x0 / norm
    for k in range(d):
        w = A @ Q[:, k]
        if k > 0:
            w = w - beta[k - 1] * Q[:, k - 1]
        alpha[k] = np.real(np.vdot(Q[:, k], w))
        w = w - alpha[k] * Q[:, k]
        if reorthogonalize:
            w = w - Q[:, : k + 1] @ (Q[:, : k + 1].conj().T @ w)
        if k + 1 < d:
            beta[k] = np.linalg.norm(w)
            Q[:, k + 1] = w / beta[k]
    return Q, alpha, beta, w, norm


# ------------------------------------------------------------ NumPy problems

# `jax.random` compiles a program for every shape and dtype it draws, and every eager
# `jnp` operation one for every operation, shape and dtype: for the tests' small
# problems that costs more than the computations they check. These draw the data and
# build the operators and references with NumPy, so that a test compiles nothing but
# its own jitted program.


def numpy_array(seed, shape, dtype):
    """Standard normal entries in `dtype`, drawn by NumPy from `seed` (an integer or
    a tuple of them): `random_array`'s distribution, real and imaginary parts of
    variance 1/2 for a complex `dtype`."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.complexfloating):
        z = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
        return (z / np.sqrt(2)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def numpy_problem(dtype, block=None, n=5, seed=0, scale=0.9):
    """`random_problem` drawn by NumPy: a random `(n, n)` matrix of spectral radius
    about `scale` and an `x0` of shape `(n,)` or `(n, block)`, NumPy arrays in
    `dtype`."""
    A = numpy_array((seed, 0), (n, n), dtype) * (scale / np.sqrt(n))
    return A.astype(dtype), numpy_array((seed, 1), x0_shape(n, block), dtype)


def numpy_like(seed, tree):
    """A pytree of NumPy `numpy_array`s with the structure, shapes and dtypes of
    `tree` (arrays, or the `jax.ShapeDtypeStruct`s of `jax.eval_shape`)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    new = [numpy_array((seed, i), x.shape, x.dtype) for i, x in enumerate(leaves)]
    return jax.tree_util.tree_unflatten(treedef, new)


def numpy_operator(kind, A):
    """`make_operator(kind, A)` for a NumPy matrix `A`, with nothing computed by
    JAX: a BCOO matrix holds `A`'s entries on `sparse_mask`, in the order of
    `BCOO.fromdense`. `dense_of_numpy(kind, A)` is the matrix it represents."""
    n = A.shape[0]
    if kind == "bcoo":
        mask = sparse_mask(n)
        indices = np.argwhere(mask).astype(np.int32)
        return A[mask], lambda data: sparse.BCOO((data, indices), shape=(n, n))
    if kind == "method":
        return MatVec(A, np.asarray(0.25, A.dtype)), lambda m: m.mv
    return make_operator(kind, A)


def dense_of_numpy(kind, A):
    """The NumPy matrix that `numpy_operator(kind, A)`'s operator represents."""
    n = A.shape[0]
    if kind == "bcoo":
        return np.where(sparse_mask(n), A, 0).astype(A.dtype)
    if kind == "method":
        return (A + 0.25 * np.eye(n)).astype(A.dtype)
    return A


def krylov_numpy(A, x0, d, layout="columns"):
    """The Krylov vectors x0, A x0, ..., A^(d-1) x0 of a NumPy matrix `A` by a NumPy
    loop, in the library's layout."""
    xs = [np.asarray(x0)]
    for _ in range(d - 1):
        xs.append(A @ xs[-1])
    rows = np.stack(xs)
    return rows if layout == "rows" else np.moveaxis(rows, 0, 1)


def adam_losses(model, loss, learning_rate, steps=4):
    """The losses of `steps` jitted Adam steps on `loss(model)`, first to last.

    optax mixes its int32 step count with floats, which strict promotion
    (conftest.py) refuses; the model itself runs under strict promotion."""
    optimiser = optax.adam(learning_rate)

    @jax.jit
    def step(model, state):
        value, grad = jax.value_and_grad(loss)(model)
        with jax.numpy_dtype_promotion("standard"):
            updates, state = optimiser.update(grad, state, model)
        return optax.apply_updates(model, updates), state, value

    state = optimiser.init(model)
    losses = []
    for _ in range(steps):
        model, state, value = step(model, state)
        losses.append(float(value))
    return losses
