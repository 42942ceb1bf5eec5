r"""Sharding: what every module asks of an array's placement, answered once.

JAX has two kinds of mesh axes. On an `Auto` mesh (or on one device) XLA's
partitioner places every intermediate itself, and the library does nothing. On a
mesh with `Explicit` axes the sharding is part of an array's type: a scan carry
must keep its type, a VJP takes cotangents typed exactly like the function's
output, a contraction over an axis that both operands shard must be told where
its result lives, and a gather or scatter cannot infer its result's sharding.
The questions the algorithms ask are:

- `is_explicit(x)`: does `x` lie on a mesh with an `Explicit` axis (replicated
  or not)? Then its type carries its sharding (`typed_like`, `like_input`,
  `gathered`).
- `is_split(x)`: is `x` also split along one of its axes there? Then one of its
  entries cannot be sliced out without a collective, and a gather of it needs
  `jax.shard_map` (`_sparse.py`).
- `explicit_mesh(*trees)`: the mesh of the first array among `trees` that is
  explicit (split, with `split=True`): the mesh on which the others are placed
  (`on_common_mesh`) and the products run.
"""

import contextlib
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxtyping import Array


def _sharding_of(x: Any) -> Any:
    """The sharding of an array or `jax.ShapeDtypeStruct`: a concrete array's own
    (on a concrete `Mesh`, which an eager `reshard` needs), else its type's (on an
    abstract mesh)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x.sharding
    if isinstance(x, jax.Array) and not isinstance(x, Tracer):
        if isinstance(x.sharding, NamedSharding):
            return x.sharding
    return jax.typeof(x).sharding


def _has_explicit_axis(sharding: Any) -> bool:
    mesh = getattr(sharding, "mesh", None)
    return mesh is not None and AxisType.Explicit in mesh.axis_types


def _has_split_axis(sharding: Any) -> bool:
    return any(p is not None for p in getattr(sharding, "spec", ()))


def is_explicit(x: Any) -> bool:
    """Whether `x` (an array or `jax.ShapeDtypeStruct`) lies on a mesh with an
    `Explicit` axis."""
    return _has_explicit_axis(_sharding_of(x))


def is_split(x: Any) -> bool:
    """Whether `x` lies on a mesh with an `Explicit` axis and is split along one of
    its axes there."""
    sharding = _sharding_of(x)
    return _has_explicit_axis(sharding) and _has_split_axis(sharding)


def explicit_mesh(*trees: Any, split: bool = False) -> Any:
    """The mesh of the first array (or `jax.ShapeDtypeStruct`) among the leaves of
    `trees` that lies on a mesh with an `Explicit` axis (and, if `split`, is split
    there); `None` if there is none. A concrete array gives its concrete mesh."""
    for x in jtu.tree_leaves(trees):
        if not (eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)):
            continue
        if is_split(x) if split else is_explicit(x):
            return _sharding_of(x).mesh
    return None


def auto_types(mesh: Any) -> Any:
    """A context in which new arrays are typed as inside `_orthogonal.on_mesh`'s
    `auto_axes` region on `mesh` (every axis `Auto`); a null context for no mesh.
    For functions closure-converted outside that region and called inside it."""
    if mesh is None:
        return contextlib.nullcontext()
    abstract = mesh.abstract_mesh
    auto = {name: jax.sharding.AxisType.Auto for name in abstract.axis_names}
    return jax.sharding.use_abstract_mesh(abstract.update_axis_types(auto))


def typed_like(y: Array, like: Array) -> Array:
    """`y` with the sharding type of `like`; a no-op unless `like`'s mesh is
    `Explicit`.

    `A @ x` for a row-sharded `A` is typed row-sharded even when `x` is replicated,
    and a callable's output need not be sharded like its input: a scan carry and a
    cotangent are made to keep the type they must have. On an `Auto` mesh or none,
    XLA places arrays itself (and an array made inside `jax.set_mesh` may name a
    mesh that its input does not), so nothing is done.
    """
    sharding = jax.typeof(like).sharding
    if not _has_explicit_axis(sharding) or jax.typeof(y).sharding == sharding:
        return y
    return jax.sharding.reshard(y, sharding)


def as_typed(x: Any) -> Any:
    """`x` as an array of its own sharding type: on a mesh with `Explicit` axes a
    concrete array split over it (one a jitted function closes over) enters a
    trace as a constant, and `jnp.zeros_like` of it, say, is typed replicated, where the
    results of the library's loops are typed like the array; so it is resharded
    to its own sharding (outside a trace, a copy). Anything else is returned as
    it is."""
    if isinstance(x, Tracer) or not is_split(x):
        return x
    return jax.sharding.reshard(x, jax.typeof(x).sharding)


def check_invariant(tree: Any, what: str) -> None:
    """Raise a `ValueError` if an array of `tree` varies over manual mesh axes:
    inside `jax.shard_map` with `check_vma=True` (its default), where the
    decompositions' loops (whose carries start from fresh, invariant arrays) and
    the derivative rules (whose cotangents do not follow the varying types) fail
    JAX's type checks. `what`: the function or rule, for the message. With
    `check_vma=False` they run as on one device."""
    axes = set()
    for leaf in jtu.tree_leaves(tree):
        if eqx.is_array(leaf):
            manual = getattr(jax.typeof(leaf), "manual_axis_type", None)
            axes |= set(getattr(manual, "varying", ()))
    if axes:
        msg = (
            f"{what} got arrays that vary over the manual axes "
            f"{tuple(sorted(axes))} of a `jax.shard_map` with `check_vma=True` "
            f"(its default), which krylovjax does not support: pass "
            f"`check_vma=False` to `jax.shard_map`, with which krylovjax runs on "
            f"each device's arrays as on one device."
        )
        raise ValueError(msg)


def zeros_stack(x: Array, size: int) -> Array:
    """Zeros of shape `(size, *x.shape)`, each row typed like `x`: on an
    `Explicit` mesh `jnp.zeros_like` of a concrete array (one a jitted function
    closes over) is typed replicated, and a loop that writes `x`'s successors
    into the stack needs their type."""
    stack = jnp.broadcast_to(jnp.zeros_like(x)[None], (size, *x.shape))
    sharding = jax.typeof(x).sharding
    if not _has_explicit_axis(sharding):
        return stack
    rows = sharding.update(spec=P(None, *sharding.spec))
    if jax.typeof(stack).sharding == rows:
        return stack
    return jax.sharding.reshard(stack, rows)


def like_input(x: Any) -> Any:
    """The `out_sharding=` of a product with input `x`: `x`'s own sharding on an
    explicit mesh, where a contraction over an axis that both operands shard (`A`
    split by rows, and `x` too) must be told where the result lives; `None`
    (XLA's choice) elsewhere."""
    return jax.typeof(x).sharding if is_explicit(x) else None


def gathered(x: Array, axis: int | None = None) -> Array:
    """`x` gathered along `axis` (every axis: `None`) on a mesh with `Explicit`
    axes (a reshape, say, cannot merge a split axis); unchanged elsewhere."""
    sharding = jax.typeof(x).sharding
    if not _has_explicit_axis(sharding):
        return x
    spec = [*sharding.spec, *[None] * (x.ndim - len(sharding.spec))]
    for i in range(x.ndim) if axis is None else (axis,):
        spec[i] = None
    new = sharding.update(spec=P(*spec))
    return x if new == sharding else jax.sharding.reshard(x, new)


def _unplaced(x: Any) -> bool:
    return eqx.is_array(x) and jax.typeof(x).sharding.mesh.empty


def any_unplaced(tree: Any) -> bool:
    """Whether an array among the leaves of `tree` lies on no mesh."""
    return any(_unplaced(x) for x in jtu.tree_leaves(tree))


def on_common_mesh(mesh: Any, tree: Any) -> Any:
    """`tree` with each array that lies on no mesh replicated on `mesh` (`None`:
    `tree` unchanged).

    On an explicit mesh an array that was never placed (a plain `jnp.ones(n)`) has
    a type without a mesh, and it does not mix with the operator's: `A @ x0` is
    typed on `A`'s mesh, so the scan's carry, the concatenation of `x0` with the
    stack and the reverse pass's buffers would not match, and a contraction over a
    sharded axis cannot state its result's sharding on a matrix without a mesh.
    Replicated on the mesh of the others, it is what `device_put(x, P())` makes;
    its cotangent is typed on that mesh, replicated, as that of an array on no
    mesh multiplied by a placed one in JAX itself.
    """
    if mesh is None:
        return tree

    def place(x):
        if not _unplaced(x):
            return x
        x = jnp.asarray(x)
        replicated = NamedSharding(mesh, P())
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            return jax.sharding.reshard(x, replicated)
        # Not `reshard` for what may be differentiated: its transpose (like that of
        # an addition) reshards the cotangent back onto no mesh, which fails under
        # a `vmap` whose batch axis is split over the mesh (per-key gradients with
        # keys split over devices). A product with ones on the mesh places `x`
        # exactly, its cotangent stays typed on the mesh, as that of JAX's own
        # products with a placed operand does, and XLA removes it.
        return x * jnp.ones(x.shape, x.dtype, out_sharding=replicated)

    return jtu.tree_map(place, tree)


def describe_type(x: Any) -> str:
    """`x`'s type with its sharding, as JAX writes it (`float64[8@x]`); the types
    of a pytree's leaves, comma-separated (for error messages)."""
    types = []
    for leaf in jtu.tree_leaves(x):
        aval = jax.typeof(leaf)
        try:
            types.append(aval.str_short(mesh_axis_types=True))
        except TypeError:  # a JAX that does not name the axis types
            types.append(aval.str_short())
    return ", ".join(types)
