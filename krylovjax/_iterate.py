r"""`iterate`: the trajectory $x_0, f(x_0), \dots, f^{d-1}(x_0)$ of any step $f$.

The forward pass is one `lax.scan`. The reverse pass (`adjoint_states`) is written by
hand and saves only the trajectory it returns. With output
cotangents $g_0, \dots, g_{d-1}$ and step parameters $\theta$, the adjoint states are

$$\lambda_{d-1} = g_{d-1}, \qquad
  \lambda_k = g_k + \left(\partial_x f(x_k)\right)^\top \lambda_{k+1},$$

the gradient of $x_0$ is $\lambda_0$, and the gradient of $\theta$ is
$\sum_{k=0}^{d-2} \left(\partial_\theta f(x_k)\right)^\top \lambda_{k+1}$.

One reverse `lax.scan` recomputes each step's VJP from the stored state $x_k$ and
accumulates the parameter gradient in its carry. Nothing the step computes internally
(the hidden layer of an MLP, say) is saved between the passes, so residual memory is
the trajectory alone, whatever the width of the step.

**Forward and reverse mode from one rule** (the default, `adjoint="custom_jvp"`).
The JVP rule computes the tangents
$\dot x_{k+1} = \partial_x f(x_k) \dot x_k + \partial_\theta f(x_k) \dot\theta$
at the stored states with a tangent primitive (`_tangent.py`): its implementation is
one checkpointed `lax.scan` (`tangent_states`, what `jax.jvp` runs), and its transpose
rule is `adjoint_states` above (what `jax.grad` runs). `adjoint="custom_vjp"` is the
same reverse pass as a `jax.custom_vjp`, reverse mode only.
"""

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax

from ._checks import as_array, check_choice, check_depth, check_output_size
from ._operator import closure_convert, convert_callable
from ._rules import cotangent_like, reverse_rule
from ._sequence import ADJOINTS, Adjoint, trajectory, with_first
from ._sharding import (
    any_unplaced,
    check_invariant,
    explicit_mesh,
    on_common_mesh,
    typed_like,
)
from ._tangent import is_tangent, like_tangent, nones, tangent_primitive
from ._typing import StaticInt

_State = TypeVar("_State")


def iterate(
    step: Callable[[_State], _State],
    x0: _State,
    d: StaticInt,
    *,
    adjoint: Adjoint = "custom_jvp",
) -> _State:
    r"""Stack the trajectory $x_0, f(x_0), f(f(x_0)), \dots$ of $d$ states.

    The general recurrence $x_{k+1} = f(x_k)$, possibly nonlinear, where the state is
    any pytree of arrays. [`krylovjax.krylov`][] is the linear special case with
    matrix-specific shortcuts; use `iterate` for everything else.

    **Arguments:**

    - `step`: the map $f$. A callable taking and returning a pytree with the same
        structure, shapes and dtypes as `x0`: a function (which may close over
        arrays), an `equinox.Module`, a bound method. Gradients reach every
        floating-point array it holds.
    - `x0`: the initial state, a pytree of floating-point or complex arrays.
    - `d`: the number of states, a static Python `int >= 1` (so $d - 1$ steps).
    - `adjoint`: `"custom_jvp"` (default): one rule for forward and reverse mode
        (`jax.jvp`, `jax.jacfwd`, `jax.grad`, `jax.vjp`, `jax.hessian`); reverse
        mode is the hand-written pass, which saves only the returned trajectory and
        recomputes each step's VJP from it. `"custom_vjp"`: the same reverse pass as
        a `jax.custom_vjp`; `jax.jvp` and `jax.jacfwd` raise a `TypeError`.
        `"autodiff"`: JAX's own rules through the same `lax.scan`, saving every
        step's internals in reverse mode.

    **Returns:**

    A pytree like `x0` whose every leaf has a new leading axis of length `d`
    (the `lax.scan` convention). Structures, shapes and dtypes are checked at trace
    time; values are not: a `nan` or `inf` that the step produces propagates as in
    any JAX computation.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp
        >>> import krylovjax
        >>> w = jnp.array(0.5)
        >>> xs = krylovjax.iterate(lambda x: jnp.tanh(w * x), jnp.array([1.0, 2.0]), 3)
        >>> xs.shape
        (3, 2)
        >>> grad = jax.grad(lambda x: krylovjax.iterate(jnp.sin, x, 5).sum())
        >>> grad(jnp.array(0.0))
        Array(5., dtype=float32)

        ```
    """
    d = check_depth(d, "iterate")
    check_choice(adjoint, ADJOINTS, "iterate(adjoint=...)")
    x0 = _as_state(x0, d)
    if not callable(step):
        msg = (
            f"`iterate(step=...)` must be callable; got an object of type "
            f"{type(step).__name__}."
        )
        raise TypeError(msg)
    fn, out = convert_callable(step, x0, "iterate(step=...)", "iterate(x0=...)")
    _check_step_output(out, x0)
    mesh = explicit_mesh(fn, x0, out)
    if mesh is not None:
        # On an explicit mesh the scan's carry keeps x0's type: arrays placed on no
        # mesh are replicated on it, and each new state is typed like the last.
        if any_unplaced(x0):
            # Converted again with x0 on the mesh, as `krylov` does for a callable.
            x0 = on_common_mesh(mesh, x0)
            fn = closure_convert(step, x0)
        fn = _TypedLikeInput(on_common_mesh(mesh, fn))
    step = fn
    if d == 1:
        return jtu.tree_map(lambda x: x[None], x0)
    if adjoint == "custom_vjp":
        return _iterate_custom_vjp(step, x0, d)
    if adjoint == "custom_jvp":
        return _iterate_custom_jvp(step, x0, d=d)
    return iterate_scan(step, x0, d)


def _as_state(x0: Any, d: int) -> Any:
    # `None` is an empty subtree, not a leaf: it passes through untouched.
    leaves, treedef = jtu.tree_flatten(x0)
    if not leaves:
        msg = "`iterate(x0=...)` must hold at least one array; got an empty pytree."
        raise ValueError(msg)
    leaves = [as_array(leaf, "iterate(x0=...)") for leaf in leaves]
    check_output_size(d, leaves, "iterate")
    return jtu.tree_unflatten(treedef, leaves)


def _check_step_output(out: Any, x0: Any) -> None:
    x0_struct = jax.eval_shape(lambda: x0)
    if jtu.tree_structure(out) != jtu.tree_structure(x0_struct):
        msg = (
            f"`iterate(step=...)` must return a pytree with the structure of `x0`, "
            f"{jtu.tree_structure(x0_struct)}; it returned {jtu.tree_structure(out)}."
        )
        raise TypeError(msg)
    wants = jtu.tree_leaves_with_path(x0_struct)
    for got, (path, want) in zip(jtu.tree_leaves(out), wants, strict=True):
        where = f"`x0{jtu.keystr(path)}`"
        if got.shape != want.shape:
            msg = (
                f"`iterate(step=...)` must return arrays of the same shapes as `x0`; "
                f"expected shape {want.shape}, got {got.shape} for the leaf {where}."
            )
            raise ValueError(msg)
        if got.dtype != want.dtype:
            msg = (
                f"`iterate(step=...)` must return arrays of the same dtypes as `x0`; "
                f"expected dtype {want.dtype}, got {got.dtype} for the leaf {where}."
            )
            raise TypeError(msg)


class _TypedLikeInput(eqx.Module):
    """`step` with each leaf of its output typed like its input (`typed_like`): on
    an explicit mesh `S @ x` for a row-sharded `S` is sharded by rows whatever `x`
    is, and a scan's carry must keep its type. Its derivatives are the step's, with
    each cotangent and tangent typed like the state."""

    step: Callable

    def __call__(self, x):
        return jtu.tree_map(typed_like, self.step(x), x)


def iterate_scan(step: Any, x0: Any, d: int) -> Any:
    """The forward pass: one `lax.scan`, states stacked on a new leading axis."""
    return with_first(x0, trajectory(step, x0, d - 1))


def _iterate_adjoint(step, x0, xs, g, want_params, d):
    del x0, d
    return adjoint_states(step, xs, g, want_params)


# The same reverse pass as a `jax.custom_vjp` (reverse mode only).
_iterate_custom_vjp = reverse_rule(iterate_scan, _iterate_adjoint)


def adjoint_states(step: Any, xs: Any, g: Any, want_params: bool) -> tuple[Any, Any]:
    r"""The reverse pass: $\lambda_0$ and, if `want_params`, the step's gradient.

    One reverse `lax.scan` over the stored states `xs` and their cotangents `g`:
    each step recomputes the VJP of the step at $x_k$, so nothing the step computes
    internally is kept between the passes.
    """
    d = jtu.tree_leaves(xs)[0].shape[0]
    diff, static = eqx.partition(step, eqx.is_inexact_array)
    # A NumPy cotangent (`vjp_fn(np.ones(...))`) cannot be indexed by the traced
    # step counter below; on an explicit mesh the adjoint carry is typed like the
    # states.
    g = cotangent_like(g, xs)

    def body(carry, k):
        lam_next, acc = carry
        x_k = jtu.tree_map(lambda x: x[k], xs)
        if want_params:
            _, vjp = jax.vjp(lambda p, x: eqx.combine(p, static)(x), diff, x_k)
            ct_params, ct_x = vjp(lam_next)
            acc = jtu.tree_map(lambda a, c: a + typed_like(c, a), acc, ct_params)
        else:
            _, vjp = jax.vjp(step, x_k)
            (ct_x,) = vjp(lam_next)
        lam = jtu.tree_map(lambda gk, c, x: typed_like(gk[k] + c, x), g, ct_x, x_k)
        return (lam, acc), None

    lam_last = jtu.tree_map(lambda gx: gx[d - 1], g)
    acc0 = jtu.tree_map(jnp.zeros_like, diff) if want_params else None
    (lam0, acc), _ = lax.scan(body, (lam_last, acc0), jnp.arange(d - 1), reverse=True)
    return acc, lam0


def tangent_states(step: Any, xs: Any, t_step: Any, t_x0: Any) -> Any:
    r"""The tangents $\dot x_{k+1} = \partial_x f(x_k) \dot x_k
    + \partial_\theta f(x_k) \dot\theta$ at the stored states, stacked like `xs`.

    One `lax.scan`; its body is checkpointed, so JAX's own reverse mode through it
    (second derivatives) recomputes each step rather than saving its internals.
    """
    d = jtu.tree_leaves(xs)[0].shape[0]
    diff, static = eqx.partition(step, eqx.is_inexact_array)
    t_diff = _zeros_if_none(eqx.filter(t_step, eqx.is_inexact_array), diff)

    @jax.checkpoint
    def tangent_step(t, x_k):
        _, t_next = jax.jvp(
            lambda p, x: eqx.combine(p, static)(x), (diff, x_k), (t_diff, t)
        )
        return t_next

    def body(t, k):
        x_k = jtu.tree_map(lambda x: x[k], xs)
        t_next = tangent_step(t, x_k)
        return t_next, t_next

    _, t_rest = lax.scan(body, t_x0, jnp.arange(d - 1))
    return jtu.tree_map(lambda a, b: jnp.concatenate([a[None], b]), t_x0, t_rest)


def _tangent_transpose(inputs, g):
    step, xs, t_step, _ = inputs
    want_params = is_tangent(t_step)
    grad_step, lam0 = adjoint_states(step, xs, g, want_params)
    ct_step = like_tangent(t_step, grad_step) if want_params else nones(t_step)
    return nones(step), nones(xs), ct_step, lam0


# Arguments: (step, xs, t_step, t_x0); the tangents are like `xs`.
iterate_tangent = tangent_primitive(
    "iterate_tangent", tangent_states, _tangent_transpose, like=1
)


def _zeros_if_none(tangent, primal):
    """Materialise symbolic-zero (`None`) tangents of floating-point leaves."""

    def materialise(t, p):
        if t is not None:
            return t
        return None if p is None else jnp.zeros_like(p)

    return jtu.tree_map(materialise, tangent, primal, is_leaf=lambda t: t is None)


@eqx.filter_custom_jvp
def _iterate_custom_jvp(step, x0, *, d: int):
    return iterate_scan(step, x0, d)


@_iterate_custom_jvp.def_jvp
def _iterate_jvp(primals, tangents, *, d):
    check_invariant(primals, "The derivative of `iterate`")
    step, x0 = primals
    t_step, t_x0 = tangents
    xs = iterate_scan(step, x0, d)
    t_x0 = _zeros_if_none(t_x0, x0)
    return xs, iterate_tangent(step, xs, t_step, t_x0)
