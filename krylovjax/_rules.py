r"""The derivative plumbing that every hand-written rule shares, written once.

Each method of the library (the scan of `krylov`, doubling, `iterate`, the
decompositions, the BCOO products) has a forward pass and a hand-written reverse
pass. What connects them to JAX is the same everywhere, and lives here:

- `reverse_rule(forward, adjoint)`: a `jax.custom_vjp` (Equinox's filtered one)
  whose only residual is its output and whose backward pass is `adjoint`;
- `cotangent_like(ct, like)`: a cotangent as a JAX array typed like the output it
  belongs to (`None` for a symbolic zero, a NumPy array from
  `vjp_fn(np.ones(...))`, a sharding that differs on an `Explicit` mesh);
- `tangent_or_none(t)`: `None` for a tangent without array leaves, so that a rule
  skips the products with a zero tangent;
- `fold_batch(xs, axes, at)`: under `jax.vmap` with one operator, a batch axis
  moved into each vector (unbatched arguments broadcast), so that a tangent
  primitive is bound again on the whole batch and `grad` of a vmapped call still
  runs the hand-written reverse pass.

The tangent primitives themselves (forward and reverse mode from one rule) are
built by `_tangent.tangent_primitive`.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu

from ._sharding import check_invariant, typed_like


def cotangent_like(ct: Any, like: Any) -> Any:
    """`ct` as JAX arrays typed like `like`, leaf by leaf; zeros for a `None`
    (symbolic zero) cotangent. A `None` leaf of `like` stays `None`."""

    def one(x, c):
        if x is None:
            return None
        return jnp.zeros_like(x) if c is None else typed_like(jnp.asarray(c), x)

    if ct is None:
        return jtu.tree_map(jnp.zeros_like, like)
    return jtu.tree_map(one, like, ct, is_leaf=lambda v: v is None)


def tangent_or_none(t: Any) -> Any:
    """`None` for a tangent with no array leaves (a zero tangent), else `t`."""
    return None if t is None or not jtu.tree_leaves(t) else t


def fold_batch(
    xs: tuple[Any, ...], axes: tuple[int | None, ...], at: tuple[int, ...]
) -> tuple[Any, ...]:
    """Each array of `xs` with its batch axis (`axes`; `None`: unbatched, then
    broadcast) moved to position `at`."""
    size = next(x.shape[a] for x, a in zip(xs, axes, strict=True) if a is not None)

    def one(x, axis, position):
        if axis is None:
            x = jnp.expand_dims(x, position)
            return jnp.broadcast_to(
                x, (*x.shape[:position], size, *x.shape[position + 1 :])
            )
        return jnp.moveaxis(x, axis, position)

    return tuple(one(*args) for args in zip(xs, axes, at, strict=True))


def reverse_rule(
    forward: Callable[[Any, Any, int], Any],
    adjoint: Callable[..., tuple[Any, Any]],
) -> Callable[[Any, Any, int], Any]:
    """`forward(params, x0, d)` differentiated in reverse mode by `adjoint`.

    `adjoint(params, x0, out, ct, want_params, d)` returns the cotangents
    `(ct_params, ct_x0)`; `out` (the forward output) is the only residual, `ct`
    comes through `cotangent_like`, and `want_params` says whether any of
    `params`' arrays is differentiated (else `ct_params` is discarded).
    """

    @eqx.filter_custom_vjp
    def rule(vjp_arg, d):
        params, x0 = vjp_arg
        return forward(params, x0, d)

    @rule.def_fwd
    def _fwd(perturbed, vjp_arg, d):
        del perturbed
        check_invariant(vjp_arg, "A reverse-mode rule (`custom_vjp`)")
        out = rule.fn(vjp_arg, d)
        return out, out

    @rule.def_bwd
    def _bwd(out, ct, perturbed, vjp_arg, d):
        params, x0 = vjp_arg
        want_params = bool(jtu.tree_leaves(perturbed[0]))
        ct = cotangent_like(ct, out)
        ct_params, ct_x0 = adjoint(params, x0, out, ct, want_params, d)
        if not want_params:
            ct_params = jtu.tree_map(
                lambda _: None, eqx.filter(params, eqx.is_inexact_array)
            )
        return ct_params, ct_x0

    def call(params: Any, x0: Any, d: int) -> Any:
        return rule((params, x0), d)

    return call
