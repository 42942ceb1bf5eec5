r"""`LinearDynamics`: a learnable discrete-time linear system unrolled by `krylov`.

The layer holds a transition matrix $K \in \mathbb{R}^{n \times n}$ and, optionally,
an initial state $x_0 \in \mathbb{R}^n$, and returns the trajectory
$[x_0, K x_0, \dots, K^{d-1} x_0]$. It is a thin wrapper around
[`krylovjax.krylov`][], so its reverse pass is the single-buffer adjoint: the
gradient of $K$ is one matrix product of the adjoint buffer with the stored states.
"""

import math

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
from jaxtyping import Array, ArrayLike, DTypeLike, Inexact, PRNGKeyArray, Shaped

from .._checks import (
    as_input,
    check_allocation,
    check_dtype,
    check_output_size,
    check_shape,
    check_size,
)
from .._krylov import krylov
from .._typing import StaticInt
from ._init import uniform


class LinearDynamics(eqx.Module):
    r"""A learnable linear recurrence $x_{t+1} = K x_t$, unrolled for `horizon` steps.

    The output is the trajectory, one state per row,

    $$X = \begin{bmatrix} x_0^\top \\ (K x_0)^\top \\ \vdots \\
    (K^{d-1} x_0)^\top \end{bmatrix} \in \mathbb{R}^{d \times n},$$

    built by [`krylovjax.krylov`][] (`layout="rows"`), so gradients with respect to
    $K$ and $x_0$ use its single-buffer reverse pass.

    The transition matrix is initialised like `equinox.nn.Linear`, with entries
    drawn from $\mathcal{U}(-1/\sqrt{n}, 1/\sqrt{n})$ (spectral radius about
    $1/\sqrt{3}$, so the initial trajectory decays); the initial state from
    $\mathcal{N}(0, I)$. Both are created in the layer's `dtype`.

    !!! Example

        ```python
        >>> import jax, jax.numpy as jnp
        >>> from krylovjax.nn import LinearDynamics
        >>> model = LinearDynamics(3, 5, key=jax.random.key(0))
        >>> model().shape
        (5, 3)
        >>> fixed = LinearDynamics(3, 5, learn_x0=False, key=jax.random.key(0))
        >>> fixed(jnp.ones(3), horizon=8).shape
        (8, 3)
        >>> grads = jax.grad(lambda m: jnp.sum(m() ** 2))(model)
        >>> grads.transition.shape, grads.x0.shape
        ((3, 3), (3,))
        >>> LinearDynamics(3, 5, dtype=jnp.complex64, key=jax.random.key(0))().dtype
        dtype('complex64')

        ```
    """

    transition: Inexact[Array, "n n"]
    x0: Inexact[Array, " n"] | None
    state_size: int = eqx.field(static=True)
    horizon: int = eqx.field(static=True)
    learn_x0: bool = eqx.field(static=True)

    def __init__(
        self,
        state_size: StaticInt,
        horizon: StaticInt,
        *,
        learn_x0: bool | np.bool_ = True,
        dtype: DTypeLike | None = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `state_size`: the state dimension $n$, an `int >= 1`.
        - `horizon`: the default number of states $d$ in the returned trajectory
            (so $d - 1$ applications of $K$), an `int >= 1`.
        - `learn_x0`: if `True` (default) the layer holds a learnable initial state;
            if `False` the initial state must be passed at every call.
        - `dtype`: the dtype of the parameters, floating point or complex. Defaults
            to `jax.numpy.float32` or `jax.numpy.float64` depending on whether JAX
            is in 64-bit mode, as in `equinox.nn.Linear`.
        - `key`: a `jax.random` key for the initialisation (keyword only).
        """
        n = check_size(state_size, "LinearDynamics(state_size=...)", what="a size")
        d = check_size(horizon, "LinearDynamics(horizon=...)", what="the trajectory")
        if not isinstance(learn_x0, bool | np.bool_):
            msg = (
                f"`LinearDynamics(learn_x0=...)` must be a bool; got {learn_x0!r} "
                f"of type {type(learn_x0).__name__}."
            )
            raise TypeError(msg)
        dtype = check_dtype(dtype, "LinearDynamics(dtype=...)")
        check_allocation((n, n), dtype, "LinearDynamics(state_size=...)", "the matrix")
        check_output_size(
            d,
            [jax.ShapeDtypeStruct((n,), dtype)],
            "LinearDynamics",
            arg="LinearDynamics(horizon=...)",
            what="the state",
        )
        tkey, xkey = jr.split(key)
        self.transition = uniform(tkey, (n, n), dtype, 1 / math.sqrt(n))
        self.x0 = jr.normal(xkey, (n,), dtype) if learn_x0 else None
        self.state_size = n
        self.horizon = d
        self.learn_x0 = bool(learn_x0)

    def __call__(
        self,
        x0: Shaped[ArrayLike, " n"] | list | tuple | None = None,
        *,
        horizon: StaticInt | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Inexact[Array, "d n"]:
        r"""**Arguments:**

        - `x0`: the initial state, shape `(state_size,)`. Optional when the layer
            was built with `learn_x0=True` (a passed `x0` then replaces the learned
            one for this call); required when it was built with `learn_x0=False`.
            To run a batch of initial states use `jax.vmap(model)(x0s)`. Any array
            of numbers, or nested lists: it is promoted with the layer's dtype
            (`jnp.promote_types` by JAX's standard rules, also under strict dtype
            promotion), so an integer or boolean `x0` gives the same trajectory as
            `x0.astype(dtype)`.
        - `horizon`: the number of states for this call, overriding the layer's
            `horizon`. It fixes the output shape, so it must be a static Python
            `int >= 1` (under `jax.jit`, close over it or mark it static).
        - `key`: ignored; accepted for compatibility with `equinox.nn`.

        **Returns:**

        The trajectory $[x_0, K x_0, \dots, K^{d-1} x_0]$ as an array of shape
        `(d, state_size)`, one state per row, in the layer's dtype promoted with
        that of `x0`.
        """
        del key
        d = self.horizon
        if horizon is not None:
            d = check_size(
                horizon, "LinearDynamics.__call__(horizon=...)", what="the trajectory"
            )
        if x0 is None:
            if self.x0 is None:
                msg = (
                    "`LinearDynamics.__call__(x0=...)` is required: the layer was "
                    "built with `learn_x0=False`, so it holds no initial state; pass "
                    f"one of shape ({self.state_size},)."
                )
                raise ValueError(msg)
            x0 = self.x0
        else:
            x0 = as_input(x0, "LinearDynamics.__call__(x0=...)", self.transition.dtype)
            check_shape(
                x0,
                (self.state_size,),
                "LinearDynamics.__call__(x0=...)",
                f"to match `state_size={self.state_size}`",
            )
        arg = "LinearDynamics(horizon=...)"
        if horizon is not None:
            arg = "LinearDynamics.__call__(horizon=...)"
        check_output_size(d, [x0], "LinearDynamics", arg=arg, what="the state")
        return krylov(self.transition, x0, d, layout="rows")
