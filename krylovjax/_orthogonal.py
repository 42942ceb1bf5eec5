r"""What `arnoldi` and `lanczos` share: checks, dtypes, breakdown, and the derivative
rule.

Both build an orthonormal basis $Q = [q_0, \dots, q_{d-1}]$ of the Krylov space of
$A$ and $x_0$ by one `lax.scan`. They share:

- the argument checks and the choice of the dtype to compute in
  (`check_problem`, which the functions built on the decompositions call too),
  and running a decomposition in it (`decompose`);
- the first vector, $\nu = \|x_0\|$, $q_0 = x_0 / \nu$, and the normalisation of
  every new vector, with its breakdown rule (`next_vector`), its tangent and its
  adjoint (`next_tangent`, `next_adjoint`);
- the plumbing of the derivative rule (`derivative_rule`): a
  `equinox.filter_custom_jvp` whose tangent output comes from a tangent primitive
  (`_tangent.py`), whose implementation is the method's tangent scan and whose
  transpose is the method's reverse scan followed by one batched product for the
  operator's gradient.

**Norms.** Every norm (`safe_norm`: $\nu$, $\beta_k$ and the breakdown scale
$\|A q_k\|$) is scaled as BLAS `nrm2` is: the vector is multiplied by a power of
two near the reciprocal of its largest entry before the squares are summed, so no
square over- or underflows, and a problem scaled by any factor within the dtype's
range gives the scaled decomposition ($A \to sA$ scales $H$ and $r$, $x_0 \to s
x_0$ scales $\nu$; $Q$ is unchanged). The power of two is exact, so where the
squares fit the result has the bits of the unscaled sum. Every division is by a
norm (`quotient`), made by a power of two of the same size: JAX's rule for a
quotient multiplies by the square of the divisor, and so the derivatives of every
order, JAX's (`adjoint="autodiff"`, `jax.hessian`) and the hand-written ones,
stay in range too. Everything else is an inner product with a unit vector or a
linear combination, homogeneous in the scale.

**Dtypes.** A problem in a floating dtype narrower than float32 (bfloat16,
float16) is decomposed in float32 (`working_dtype`). In the half dtype the
breakdown threshold below would be $0.78 \|A q_k\|$ (bfloat16) or $0.1 \|A
q_k\|$ (float16), which drops genuine new directions: with a spectrum in $[10,
12]$ every $w_k$ is under it, and the basis stops after one vector. A dense or
BCOO matrix is cast to float32; a callable is wrapped so that it still receives
and returns vectors of its own dtype (a half-precision model keeps running in
it); every output is cast back to the problem's dtype. The casts lie outside the
derivative rule, so JAX differentiates them and the rule runs in float32. Other
dtypes are computed in themselves.

**Breakdown.** A new vector $w_k$ (what remains of $A q_k$ after the
orthogonalisation) whose norm is at most `BREAKDOWN` $\cdot\, \varepsilon \, \|A
q_k\|$ ($\varepsilon$ the machine epsilon of the dtype computed in) is numerically
zero: the Krylov space is invariant under $A$ (to rounding) after $k + 1$ vectors.
Then $q_{k+1} = 0$ and the subdiagonal entry is $0$, so every later vector and
coefficient is zero too, and the residual $r$ is that step's $w_k$ (`last_step`
finds the step from the outputs): $A Q = Q H + r e_k^\top$. A zero $x_0$ gives
$\nu = 0$ and an all-zero result. The threshold is relative to $\|A q_k\|$ because
the rounding error of the orthogonalisation is: with `reorthogonalize=True` the
computed $w_k$ of an invariant space is a few $\varepsilon \|A q_k\|$ long, well
under the threshold, while a genuine new direction that short could not be
resolved in the dtype anyway: $100\,\varepsilon$ is $1.2 \cdot 10^{-5}$ in float32
and $2.2 \cdot 10^{-14}$ in float64. It is the only tolerance of the
decompositions. Divisions use the double-`where` trick, so values and derivatives
stay finite.

**Stopping early.** A decomposition can be given a stop test (`AbstractStop`),
called on the small matrix after each step: where it passes at step $k$, the step
ends as a breakdown does ($\beta_k = 0$, $q_{k+1} = 0$, $r = w_k$) and the later
steps are skipped, the buffer keeping its static size $d$ (`loop_steps`: a
`while_loop` in the forward pass of the derivative rules, which JAX does not
differentiate; a `lax.cond` in the scan of `adjoint="autodiff"`). The derivative
rules need nothing new: they already give zero tangents after a zero $\beta_k$,
and they read the residual's step from the outputs, so the derivatives are exact
for the $k + 1$ vectors returned. The test's decision has no derivative (the depth
is piecewise constant), and no `while_loop` is ever differentiated.

**Conventions for complex numbers.** Inner products conjugate their first
argument, $\langle a, b \rangle = a^H b$. The maths of the adjoints is written with
Riesz gradients $g = \partial L / \partial \operatorname{Re} x + i\,\partial L /
\partial \operatorname{Im} x$ (the direction of steepest ascent, so that
$\delta L = \operatorname{Re} \langle g, \delta x\rangle$); JAX's cotangents are
their complex conjugates, $\bar x = \overline{g}$, and the rules convert once at
each end. For real dtypes the two coincide.
"""

import abc
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax.core import ShapedArray
from jax.experimental import sparse
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from ._checks import as_array, check_choice, check_depth, check_output_size
from ._operator import (
    AbstractOperator,
    DenseOperator,
    FunctionOperator,
    SparseOperator,
    as_operator,
)
from ._rules import cotangent_like, fold_batch, tangent_or_none
from ._sharding import check_invariant, explicit_mesh, typed_like
from ._tangent import is_tangent, like_tangent, nones, tangent_primitive

# The derivative rules `arnoldi` and `lanczos` offer, by their `adjoint=` names.
Adjoint = Literal["custom_jvp", "autodiff"]
ADJOINTS: tuple[Adjoint, ...] = ("custom_jvp", "autodiff")

# A new vector shorter than this many machine epsilons times ||A q_k|| is zero.
BREAKDOWN = 100


# Problems in a floating dtype of fewer bits are decomposed in this one.
LEAST_BITS = 32


def working_dtype(dtype: Any) -> np.dtype:
    """The dtype in which `arnoldi` and `lanczos` compute a problem in `dtype`:
    float32 for a real floating dtype narrower than it (bfloat16, float16), whose
    `BREAKDOWN` epsilons would be most of a vector's length; `dtype` itself
    otherwise."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < LEAST_BITS:
        return np.dtype(np.float32)
    return dtype


def check_problem(
    A: Any,
    x0: Any,
    d: Any,
    reorthogonalize: Any,
    adjoint: Any,
    fn_name: str,
    vector: str = "x0",
    length: str | None = None,
) -> tuple[AbstractOperator, Array, int]:
    """Check the arguments of `arnoldi` or `lanczos` (or of a function built on
    them, whose starting vector is called `vector`, and whose n is `length`, by
    default the length of `vector`); return them in internal form.

    `x0` comes back in the problem's dtype (`A`'s and `x0`'s, promoted), the dtype
    of every output; the operator computes in `working_dtype` of it, the one
    place where that is decided: a matrix is cast, a callable is wrapped so that
    it still receives and returns the problem's dtype. `decompose` casts `x0` and
    the outputs."""
    if not isinstance(reorthogonalize, bool | np.bool_):
        msg = (
            f"`{fn_name}(reorthogonalize=...)` must be a bool; got "
            f"{reorthogonalize!r} of type {type(reorthogonalize).__name__}."
        )
        raise TypeError(msg)
    check_choice(adjoint, ADJOINTS, f"{fn_name}(adjoint=...)")
    d = check_depth(d, fn_name)
    x0 = as_array(x0, f"{fn_name}({vector}=...)")
    if x0.ndim != 1:
        msg = (
            f"`{fn_name}({vector}=...)` must be one vector of shape (n,); got shape "
            f"{x0.shape}. For a batch of starting vectors, use `jax.vmap`."
        )
        raise ValueError(msg)
    check_output_size(d, [x0], fn_name)
    operator, x0 = as_operator(A, x0, fn_name, vector)
    check_invariant((operator, x0), f"`{fn_name}`")
    n = x0.shape[0]
    if d > n:
        msg = (
            f"`{fn_name}(d=...)` must be at most n = {n}, "
            f"{length or f'the length of `{vector}`'} (an orthonormal basis of "
            f"length-{n} vectors has at most {n} of them); got {d}."
        )
        raise ValueError(msg)
    return _in_dtype(operator, working_dtype(x0.dtype)), x0, d


class _Cast(eqx.Module):
    r"""A callable of vectors in `dtype`, applied to vectors of another dtype:
    $v \mapsto$ `fn(v.astype(dtype)).astype(v.dtype)` (differentiable)."""

    fn: Callable[[Array], Array]
    dtype: np.dtype = eqx.field(static=True)

    def __call__(self, v: Array) -> Array:
        return self.fn(v.astype(self.dtype)).astype(v.dtype)


def _in_dtype(operator: AbstractOperator, dtype: np.dtype) -> AbstractOperator:
    """`operator` (as `as_operator` makes it) computing in `dtype`."""
    if isinstance(operator, DenseOperator):
        if operator.matrix.dtype == dtype:
            return operator
        return DenseOperator(operator.matrix.astype(dtype))
    if isinstance(operator, SparseOperator):
        matrix = operator.matrix
        if matrix.data.dtype == dtype:
            return operator
        data = matrix.data.astype(dtype)
        cast = sparse.BCOO(
            (data, matrix.indices),
            shape=matrix.shape,
            indices_sorted=matrix.indices_sorted,
            unique_indices=matrix.unique_indices,
        )
        return SparseOperator(cast, operator.transposed)
    assert isinstance(operator, FunctionOperator)
    structure = operator.in_structure
    if structure.dtype == dtype:
        return operator
    fn = _Cast(operator.fn, np.dtype(structure.dtype))
    return FunctionOperator(fn, structure.update(dtype=dtype))


# What each output of a decomposition is, for its sharding on an Explicit mesh.
OutputKind = Literal["rows", "vector", "small"]


class _OnExplicitAxes(eqx.Module):
    """A callable operator's function run with the mesh's axes `Explicit`, inside
    a decomposition that runs with them `Auto` (`on_mesh`).

    The callable was written, traced and closure-converted for the `Explicit`
    mesh: its jaxpr replays there, and the arrays it reads without holding them
    (the globals of a plain function) are typed there. Its arrays are the leaves
    (typed `Auto` inside the decomposition, as its rule needs to add their
    cotangents) and go back to their own shardings for the call, the input to
    `x0`'s; the output comes back `Auto`."""

    arrays: Any
    rest: Any = eqx.field(static=True)
    specs: Any = eqx.field(static=True)
    x_spec: Any = eqx.field(static=True)

    def __call__(self, x: Array) -> Array:
        def call(arrays: Any, x: Array) -> Array:
            return eqx.combine(arrays, self.rest)(x)

        run: Any = jax.sharding.explicit_axes(
            call, in_sharding=(self.specs, self.x_spec)
        )
        return run(self.arrays, x)


def _explicit_inside(operator: AbstractOperator, x0: Array) -> AbstractOperator:
    """`operator`, a callable one made to run on the `Explicit` mesh inside
    `jax.sharding.auto_axes` (see `_OnExplicitAxes`)."""
    if not isinstance(operator, FunctionOperator):
        return operator
    arrays, rest = eqx.partition(operator.fn, eqx.is_array)
    specs = jtu.tree_map(lambda a: jax.typeof(a).sharding.spec, arrays)
    fn = _OnExplicitAxes(arrays, rest, specs, jax.typeof(x0).sharding.spec)
    return FunctionOperator(fn, operator.in_structure)


def on_mesh(
    fn: Callable[[AbstractOperator, Array], tuple[Array, ...]],
    operator: AbstractOperator,
    x0: Array,
    kinds: tuple[OutputKind, ...],
) -> tuple[Array, ...]:
    """`fn(operator, x0)`; on a mesh with `Explicit` axes, run with them `Auto`.

    On an `Explicit` mesh every product and projection of the scans would have to
    state the sharding of its result (the Gram-Schmidt products contract over the
    sharded axis). `jax.sharding.auto_axes` runs `fn` as on an `Auto` mesh, where
    XLA places the intermediates and inserts the collectives, and types the
    outputs, named by `kinds`: the basis as rows `(d, n)` (`"rows"`) and vectors
    of length $n$ (`"vector"`) sharded like `x0`, the small outputs replicated.
    The operator's arrays are its arguments and the rest of it is closed over;
    a callable runs on the `Explicit` mesh (`_OnExplicitAxes`). `x0` lies on the
    operator's mesh whenever the operator's arrays or its output do
    (`_operator.as_operator`)."""
    mesh = explicit_mesh(operator, x0)
    if mesh is None:
        return fn(operator, x0)
    arrays, static = eqx.partition(_explicit_inside(operator, x0), eqx.is_array)

    def run_auto(arrays: Any, x0: Array) -> tuple[Array, ...]:
        inner = eqx.combine(arrays, static)
        if isinstance(inner, FunctionOperator):
            # Its input is typed on the `Auto` mesh in here.
            inner = FunctionOperator(inner.fn, jax.typeof(x0))
        return fn(inner, x0)

    spec = jax.typeof(x0).sharding.spec
    axis = spec[0] if len(spec) else None
    specs = {"rows": P(None, axis), "vector": P(axis), "small": P()}
    out_sharding = tuple(specs[kind] for kind in kinds)
    run: Any = jax.sharding.auto_axes(run_auto, out_sharding=out_sharding)
    if not jax.sharding.get_abstract_mesh().empty:
        return run(arrays, x0)
    # Arrays on an explicit mesh, called outside `jax.set_mesh`: their mesh.
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return run(arrays, x0)


def decompose(
    rule: Callable[..., tuple[Array, ...]],
    operator: AbstractOperator,
    x0: Array,
    d: int,
    reorth: bool,
    kinds: tuple[OutputKind, ...],
    *,
    rounded: bool = True,
    stop: "AbstractStop | None" = None,
) -> tuple[Array, ...]:
    """`rule(operator, x0, d, reorth, stop)` for `check_problem`'s outputs: run in
    the operator's `working_dtype` (through `on_mesh`), every output returned in
    `x0`'s dtype (its real dtype for the real outputs), or left in the working
    dtype if not `rounded`. With a `stop` test the outputs end with its estimate
    (`AbstractStop.estimate`, a small output)."""
    dtype = x0.dtype
    work = working_dtype(dtype)
    if stop is not None:
        kinds = (*kinds, "small")
    out = on_mesh(
        lambda operator, x0: rule(operator, x0, d, reorth, stop),
        operator,
        x0.astype(work),
        kinds,
    )
    if work == dtype or not rounded:
        return out
    real = jnp.finfo(dtype).dtype
    return tuple(y.astype(dtype if jnp.iscomplexobj(y) else real) for y in out)


# ------------------------------------------------------------- stopping early


class AbstractStop(eqx.Module):
    """A test of whether a decomposition stops after a step (see "Stopping early"
    in the module docstring). It carries a state from step to step."""

    @abc.abstractmethod
    def init(self, d: int) -> Any:
        """The state before the first step of a decomposition of depth `d`."""

    @abc.abstractmethod
    def __call__(
        self, state: Any, k: Array, small: Any, broken: Array
    ) -> tuple[Any, Array]:
        """After step `k`: the new state, and whether to stop. `small` is the
        small matrix of the first `k + 1` vectors, zero-padded to `d` (Lanczos: its
        diagonal and off-diagonal; Arnoldi: $H$), without derivatives; `broken`
        says whether step `k` broke down."""

    @abc.abstractmethod
    def estimate(self, state: Any) -> Array:
        """What the test reports at the end: a real scalar, the decomposition's
        last output."""


def loop_steps(
    step: Callable[[Any, Array], Any], carry: Any, d: int, early: bool
) -> Any:
    """`carry = step(carry, k)` for `k = 0, ..., d - 1`, by `lax.scan`; with
    `early`, by a `lax.while_loop` that ends after the step that ends the basis
    (`carry[-2]` says whether one has). The loop is a `while_loop` only where JAX
    never differentiates it: inside a derivative rule's forward pass."""
    if not early:
        carry, _ = lax.scan(lambda c, k: (step(c, k), None), carry, jnp.arange(d))
        return carry

    def cond(c: tuple[Array, Any]) -> Array:
        k, carry = c
        return (k < d) & ~carry[-2]

    def body(c: tuple[Array, Any]) -> tuple[Array, Any]:
        k, carry = c
        return k + 1, step(carry, k)

    return lax.while_loop(cond, body, (jnp.asarray(0), carry))[1]


def last_step(betas: Array) -> Array:
    r"""The step whose remainder $w_k$ is the residual: the first with $\beta_k = 0$
    in `betas`, the step norms with the last one (not normalised) set to zero."""
    return jnp.argmax(betas == 0)


# ------------------------------------------------------------- small pieces


def conj(x: Array) -> Array:
    """The complex conjugate; no operation at all for a real dtype."""
    return jnp.conj(x) if jnp.iscomplexobj(x) else x


def real_dot(a: Array, b: Array) -> Array:
    r"""$\operatorname{Re} \langle a, b \rangle$."""
    return jnp.real(jnp.vdot(a, b))


def project(Q: Array, w: Array) -> Array:
    r"""$Q^H w$ for the basis stored as rows `(d, n)`: the coefficients
    $\langle q_j, w \rangle$. Conjugates the two vectors, not the matrix."""
    return conj(Q @ conj(w))


def combine(Q: Array, h: Array) -> Array:
    r"""$\sum_j h_j q_j$ for the basis stored as rows `(d, n)`."""
    return h @ Q


def as_dtype(x: Array, like: Array) -> Array:
    """`x` cast to the dtype of `like` (a real scalar into a complex vector, say)."""
    return x.astype(like.dtype)


def _powers_of_two(x: Array) -> tuple[Array, Array]:
    r"""$(2^k, 2^{-k})$ for the smallest $k$ with $|x_i| < 2^k$ for every real and
    imaginary part, as constants (no derivative), with $k$ clipped so that both
    are normal numbers (its least value for a zero or subnormal `x`; $k = 0$ for
    an infinite or NaN entry, which the norm then keeps).

    Exact: scaling by a power of two changes no bits, so a norm scaled by it
    equals the unscaled one to the last bit wherever the unscaled squares neither
    over- nor underflow."""
    real = jnp.finfo(x.dtype).dtype
    magnitude = jnp.abs(jnp.real(x))
    if jnp.iscomplexobj(x):
        magnitude = jnp.maximum(magnitude, jnp.abs(jnp.imag(x)))
    # largest = m 2^k with m in [1/2, 1), so largest < 2^k.
    _, k = jnp.frexp(lax.stop_gradient(jnp.max(magnitude, initial=0)))
    least = jnp.finfo(real).minexp
    k = jnp.clip(k, least, -least)
    one = jnp.ones((), real)
    return jnp.ldexp(one, k), jnp.ldexp(one, -k)


def safe_norm(x: Array) -> Array:
    """`||x||`, with derivative 0 (not NaN) at `x = 0`; a NaN in `x` gives NaN.

    Scaled as BLAS `nrm2` is, so that no square over- or underflows: `x` is
    divided by a power of two just above its largest entry (`_powers_of_two`)
    before the squares are summed, and the root multiplied back. The scale is a
    constant for the derivative, which is exact: it is piecewise constant in `x`.
    The masks below test `!= 0` (true for NaN), never `> 0`: a NaN in the input
    must reach the output rather than be taken for a breakdown."""
    up, down = _powers_of_two(x)
    squares = jnp.sum(jnp.square(jnp.real(x) * down))
    if jnp.iscomplexobj(x):
        squares = squares + jnp.sum(jnp.square(jnp.imag(x) * down))
    nonzero = squares != 0
    return jnp.where(nonzero, up * jnp.sqrt(jnp.where(nonzero, squares, 1)), 0)


# ------------------------------------------------- the second Gram-Schmidt pass

# A second Gram-Schmidt pass against the basis runs where the first left less
# than this fraction of a vector's norm ("twice is enough": Daniel, Gragg,
# Kaufman and Stewart, 1976; Giraud, Langou and Rozloznik, 2005).
TWICE = 2**-0.5


def second_pass(Q: Array, w: Array, out: Array, rows: Array | None = None) -> Array:
    r"""`out`, the vector (or rows `(b, n)`) that one classical Gram-Schmidt pass
    against the basis `Q` (rows `(m, n)`) made from `w`, orthogonalised against
    `Q` once more where a row of it has less than `TWICE` of the norm of its row
    of `w`: there the first pass's rounding left components along `Q` as large
    as what remains. Elsewhere the second pass would change `out` by rounding
    only, and is skipped (a `lax.cond`); in exact arithmetic it changes nothing.
    With `rows`, a boolean `(m,)` mask, only those rows of `Q` are the basis (the
    others are taken for zero rows).

    It is a primitive (`_second_pass_p`) for its batching rule: under `jax.vmap`
    a `cond` becomes a `select`, which would run the pass at every step. Here the
    runs of a batch decide together, one `cond` on whether any of them needs the
    pass, which then runs for all of them: the rule binds the primitive again
    with one more batch level, so that nested `vmap`s make one decision too. The
    primitive also returns that decision, and its JVP rule takes the pass's
    tangent where it was made: a `where` on the same decision, which `vmap`
    leaves unbatched. (JAX's rule through the `cond` would, inside a `vmap`,
    become a `select` whose inputs `vmap` wraps in `stop_gradient`, which reverse
    mode cannot transpose when they are tangents.)"""
    operands = (Q, w, out) if rows is None else (Q, w, out, rows)
    return _second_pass_p.bind(*operands, levels=())[0]


def _rows(x: Array) -> Array:
    return x.reshape(-1, x.shape[-1])


def _second_pass_needed(w: Array, out: Array) -> Array:
    """Whether a row of `out` (any leading axes, batch levels included) has less
    than `TWICE` of the norm of its row of `w`."""
    norms = jax.vmap(safe_norm)
    return jnp.any(norms(_rows(out)) < TWICE * norms(_rows(w)))


def _pass_again(Q: Array, out: Array, *mask: Array) -> Array:
    rows = _rows(out)
    coefficients = conj(Q) @ rows.T
    if mask:
        coefficients = jnp.where(mask[0][:, None], coefficients, 0)
    again = rows - coefficients.T @ Q
    return typed_like(again.reshape(out.shape), out)


def _pass_again_batched(Q: Array, out: Array, mask: list, levels: tuple) -> Array:
    """`_pass_again` over the batch levels of `out`'s leading axes, outermost
    first: each a pair `(Q's axis, the mask's axis)`, `0` or `None` (shared)."""
    fn = _pass_again
    for q_axis, mask_axis in reversed(levels):
        in_axes = (q_axis, 0, *([mask_axis] if mask else []))
        fn = jax.vmap(fn, in_axes=in_axes)
    return fn(Q, out, *mask)


def _second_pass(Q: Array, w: Array, out: Array, *mask: Array, levels) -> list[Array]:
    def again(out):
        return _pass_again_batched(Q, out, list(mask), levels)

    needed = _second_pass_needed(w, out)
    return [lax.cond(needed, again, lambda out: out, out), needed]


def _second_pass_batched(args, dims, *, levels):
    (Q, w, out, *mask), (q_dim, w_dim, out_dim, *mask_dim) = args, dims
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)

    def batched(x, dim):
        if dim is None:
            return jnp.broadcast_to(x, (size, *x.shape))
        return jnp.moveaxis(x, dim, 0)

    w, out = batched(w, w_dim), batched(out, out_dim)
    q_axis = None if q_dim is None else 0
    if q_dim is not None:
        Q = jnp.moveaxis(Q, q_dim, 0)
    mask_axis = None
    if mask and mask_dim[0] is not None:
        mask, mask_axis = [jnp.moveaxis(mask[0], mask_dim[0], 0)], 0
    levels = ((q_axis, mask_axis), *levels)
    return _second_pass_p.bind(Q, w, out, *mask, levels=levels), [0, None]


def _second_pass_jvp(primals, tangents, *, levels):
    Q, w, out, *mask = primals
    t_Q, _, t_out = (ad.instantiate_zeros(t) for t in tangents[:3])
    new, needed = _second_pass_p.bind(*primals, levels=levels)

    def again(t_Q, t_out):
        def one(Q, out):
            return _pass_again_batched(Q, out, mask, levels)

        return jax.jvp(one, (Q, out), (t_Q, t_out))[1]

    # A `where`, not a `cond`: reverse mode through a `cond` inside a scan keeps
    # the basis, an operand of its branch, once per step.
    t_new = jnp.where(needed, again(t_Q, t_out), t_out)
    zero = ad.Zero(ShapedArray((), jax.dtypes.float0))
    return [new, needed], [t_new, zero]


def _second_pass_abstract(Q, w, out, *mask, levels):
    # The decision is a scalar, placed (replicated) on `out`'s mesh.
    decision = ShapedArray((), jnp.bool_, sharding=out.sharding.update(spec=P()))
    return [out, decision]


_second_pass_p = jax.extend.core.Primitive("krylovjax_second_gram_schmidt_pass")
_second_pass_p.multiple_results = True
_second_pass_p.def_impl(_second_pass)
_second_pass_p.def_abstract_eval(_second_pass_abstract)
mlir.register_lowering(_second_pass_p, mlir.lower_fun(_second_pass, True))
batching.primitive_batchers[_second_pass_p] = _second_pass_batched
ad.primitive_jvps[_second_pass_p] = _second_pass_jvp


def quotient(x: Array, y: Array) -> Array:
    r"""$x / y$ for a real scalar $y$ (a norm), as $(2^{-k} x) / (2^{-k} y)$ with
    $2^k$ the power of two just above $|y|$ (`_powers_of_two`, a constant).

    The same bits as $x / y$, but derivatives that stay finite at any order and
    in either mode: JAX's rule for a quotient multiplies by the square of the
    divisor, which over- or underflows where $|y|$ is beyond the square root of
    the dtype's range, and here the divisor is $2^{-k} y \in [1/2, 1)$."""
    _, down = _powers_of_two(y)
    return (x * as_dtype(down, x)) / as_dtype(y * down, x)


def normalize(x0: Array) -> tuple[Array, Array]:
    r"""$(\nu, q_0) = (\|x_0\|, x_0 / \|x_0\|)$, and $(0, 0)$ for a zero $x_0$."""
    nu = safe_norm(x0)
    ok = nu != 0
    q0 = jnp.where(ok, quotient(x0, jnp.where(ok, nu, 1)), 0)
    return nu, q0


def next_vector(w: Array, w0: Array) -> tuple[Array, Array]:
    r"""$(\beta, q) = (\|w\|, w / \|w\|)$, or $(0, 0)$ at breakdown:
    $\|w\| \le$ `BREAKDOWN` $\varepsilon \|w_0\|$, with $w_0 = A q_k$."""
    eps = jnp.finfo(w.dtype).eps
    scale = lax.stop_gradient(safe_norm(w0))
    beta = safe_norm(w)
    ok = ~(beta <= BREAKDOWN * eps * scale)
    beta = jnp.where(ok, beta, 0)
    q = jnp.where(ok, quotient(w, jnp.where(ok, beta, 1)), 0)
    return beta, q


def next_tangent(q: Array, beta: Array, t_w: Array) -> tuple[Array, Array]:
    r"""Tangent of `next_vector` (or of `normalize`) given its outputs:
    $\dot\beta = \operatorname{Re}\langle q, \dot w\rangle$ and
    $\dot q = (\dot w - q \dot\beta) / \beta$; both zero at breakdown ($\beta = 0$)."""
    ok = beta != 0
    t_beta = jnp.where(ok, real_dot(q, t_w), 0)
    safe = jnp.where(ok, beta, 1)
    t_q = jnp.where(ok, quotient(t_w - q * as_dtype(t_beta, q), safe), 0)
    return t_beta, t_q


def next_adjoint(q: Array, beta: Array, g_q: Array, g_beta: Array) -> Array:
    r"""Transpose of `next_tangent`: the gradient of $w$ from those of $q$ and
    $\beta$, $g_w = g_q / \beta + (g_\beta - \operatorname{Re}\langle q, g_q\rangle
    / \beta)\, q$; zero at breakdown."""
    ok = beta != 0
    safe = jnp.where(ok, beta, 1)
    g_beta = g_beta - jnp.where(ok, quotient(real_dot(q, g_q), safe), 0)
    return jnp.where(ok, quotient(g_q, safe) + q * as_dtype(g_beta, q), 0)


# `add_outer` updates the buffer this many rows at a time.
OUTER_ROWS = 8


def add_outer(
    Lam: Array, left: list[Array], right: list[Array], last: Array | int
) -> Array:
    r"""$\Lambda_{:d} \mathrel{+}= \sum_i \overline{l_i}\, r_i^\top$ for
    length-$d$ coefficient vectors $l_i$ that are zero beyond entry `last`, and
    length-$n$ vectors $r_i$, into the first $d$ rows of the $(d + 1, n)$ buffer.

    Written as elementwise sums rather than a product with the stacked vectors:
    XLA fuses each into a single pass that reads and writes its rows once, in place
    (a product of inner dimension 2 or 4 would write a full-size temporary and add
    it in a second pass). Only the blocks of `OUTER_ROWS` rows up to row `last`
    are visited, so that the steps of a reverse scan touch a triangle of the
    buffer rather than all of it each time."""
    d = Lam.shape[0] - 1
    if d <= OUTER_ROWS:
        update = Lam[:-1]
        for coefficients, vector in zip(left, right, strict=True):
            update = update + conj(coefficients)[:, None] * vector[None, :]
        return Lam.at[:-1].set(update)

    def block(b, Lam):
        # The last block is moved back to end at row d - 1; the rows it shares
        # with the block before, already updated, are masked out.
        start = jnp.minimum(b * OUTER_ROWS, d - OUTER_ROWS)
        fresh = start + jnp.arange(OUTER_ROWS) >= b * OUTER_ROWS
        update = lax.dynamic_slice_in_dim(Lam, start, OUTER_ROWS)
        for coefficients, vector in zip(left, right, strict=True):
            c = lax.dynamic_slice_in_dim(coefficients, start, OUTER_ROWS)
            c = jnp.where(fresh, conj(c), 0)
            update = update + c[:, None] * vector[None, :]
        return lax.dynamic_update_slice_in_dim(Lam, update, start, 0)

    def maybe(b, Lam):
        # A fixed number of blocks with a `cond`, rather than a loop to `last`: a
        # loop with a traced bound could not be differentiated in reverse mode.
        return lax.cond(b * OUTER_ROWS <= last, block, lambda b, Lam: Lam, b, Lam)

    return lax.fori_loop(0, -(-d // OUTER_ROWS), maybe, Lam)


def adjoint_mv(transpose_mv: Callable[[Array], Array], g: Array) -> Array:
    r"""$A^H g$ from `operator.transpose().mv`, which applies $A^\top$."""
    return conj(transpose_mv(conj(g)))


def operator_tangent(
    operator: AbstractOperator, t_operator: AbstractOperator | None, Q: Array
) -> Array | None:
    r"""$\dot A Q$ for every stored vector at once (one batched product), or `None`
    when $\dot A = 0$."""
    if t_operator is None:
        return None
    _, U = eqx.filter_jvp(lambda op: op.mm(Q), (operator,), (t_operator,))
    return U


# --------------------------------------------------------- the derivative rule

# forward(operator, x0, d, reorth, stop) -> out, where out[0] is the basis as rows
# (d, n) and out[-1] is ||x0|| (with a stop test, followed by its estimate);
# tangent(operator, out, t_operator, t_x0, reorth) -> tangents like out;
# adjoint(operator, out, ct, reorth) -> (ct_x0, ct_W): JAX cotangents of x0 and of
# the stack W = A Q, rows (d, n).
ForwardFn = Callable[..., tuple[Array, ...]]
TangentFn = Callable[..., tuple[Array, ...]]
AdjointFn = Callable[..., tuple[Array, Array]]


def _merge(x: Array) -> Array:
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def derivative_rule(
    name: str, forward: ForwardFn, tangent: TangentFn, adjoint: AdjointFn
) -> Callable[..., tuple[Array, ...]]:
    """The decomposition `forward`, differentiated by `tangent` (forward mode) and
    `adjoint` (its transpose, reverse mode) through a tangent primitive.

    The primitive's arguments are `(operator, out, t_operator, t_x0, reorth,
    batched)`: the forward output `out` and the operator are the only residuals of
    reverse mode. `batched` is set by the batching rule: under `jax.vmap` over
    `x0` with one operator, the primitive is bound again on the whole batch, so
    that `grad` of a vmapped call still runs the hand-written reverse scan (vmapped
    over the batch) and forms the operator's gradient as one product over all
    `batch * d` stored vectors.
    """

    def impl(operator, out, t_operator, t_x0, reorth, batched):
        t_x0 = jnp.asarray(t_x0)

        def one(out, t_x0):
            return tangent(operator, out, t_operator, t_x0, reorth)

        return jax.vmap(one)(out, t_x0) if batched else one(out, t_x0)

    def transpose(inputs, ct):
        operator, out, t_operator, t_x0, reorth, batched = inputs
        ct = cotangent_like(ct, out)

        def one(out, ct):
            return adjoint(operator, out, ct, reorth)

        ct_x0, ct_W = jax.vmap(one)(out, ct) if batched else one(out, ct)
        ct_operator = nones(t_operator)
        if is_tangent(t_operator):
            Q = _merge(out[0]) if batched else out[0]
            grad = operator.param_vjp(Q, _merge(ct_W) if batched else ct_W)
            ct_operator = like_tangent(t_operator, grad)
        ct_x0 = ct_x0 if is_tangent(t_x0) else None
        return nones(operator), nones(out), ct_operator, ct_x0, None, None

    def batch(bind, args, axes):
        operator, out, t_operator, t_x0, reorth, batched = args
        op_axes, out_axes, t_op_axes, t_x0_axis, _, _ = axes
        if batched or any(a is not None for a in jtu.tree_leaves((op_axes, t_op_axes))):
            return None
        leaves, treedef = jtu.tree_flatten(out)
        out_axes = treedef.flatten_up_to(out_axes)
        *leaves, t_x0 = fold_batch(
            (*leaves, t_x0), (*out_axes, t_x0_axis), (0,) * (len(leaves) + 1)
        )
        out = treedef.unflatten(leaves)
        return bind(operator, out, t_operator, t_x0, reorth, True), 0

    primitive = tangent_primitive(f"{name}_tangent", impl, transpose, 1, batch)

    # The stop test is an argument, not a keyword: it may hold arrays (what `f`
    # closes over). Its tangents are not used: the depth it chooses is piecewise
    # constant, and so is its estimate.
    @eqx.filter_custom_jvp
    def decomposition(operator, x0, stop, *, d, reorth):
        return forward(operator, x0, d, reorth, stop, early=True)

    @decomposition.def_jvp
    def _jvp(primals, tangents, *, d, reorth):
        operator, x0, stop = primals
        t_operator, t_x0, _ = tangents
        # Itself, not `forward`: a second derivative then differentiates it by
        # this rule again, never JAX's rules through the early-ending loop (a
        # `while_loop`, which reverse mode cannot differentiate).
        out = decomposition(operator, x0, stop, d=d, reorth=reorth)
        t_x0 = jnp.zeros_like(x0) if t_x0 is None else t_x0
        t_operator = tangent_or_none(t_operator)
        if stop is None:
            return out, primitive(operator, out, t_operator, t_x0, reorth, False)
        out, estimate = out[:-1], out[-1]
        t_out = primitive(operator, out, t_operator, t_x0, reorth, False)
        return (*out, estimate), (*t_out, jnp.zeros_like(estimate))

    def build(operator, x0, d, reorth, stop=None):
        return decomposition(operator, x0, stop, d=d, reorth=reorth)

    return build
