r"""What `krylov` and `iterate` share: the forward scan and the derivative options.

Both build a sequence $x_0, f(x_0), \dots, f^{d-1}(x_0)$ stacked on a new leading
axis: `krylov` with $f(x) = A x$ on one array, `iterate` with any $f$ on a pytree.
The forward pass is `trajectory` (one `lax.scan` of $d - 1$ steps) and
`with_first` (put $x_0$ in front). Their derivative rules cover only the steps,
so that $x_0$ goes in front outside them: XLA fuses that concatenation into its
consumers, and JAX adds the cotangent of the first slot to the gradient of $x_0$.
"""

from collections.abc import Callable
from typing import Literal, TypeVar

import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax

# The derivative rules both offer, by their `adjoint=` names.
Adjoint = Literal["custom_jvp", "custom_vjp", "autodiff"]
ADJOINTS: tuple[Adjoint, ...] = ("custom_vjp", "custom_jvp", "autodiff")

_State = TypeVar("_State")


def trajectory(step: Callable[[_State], _State], x0: _State, steps: int) -> _State:
    r"""$[f(x_0), \dots, f^{s}(x_0)]$ for $s$ = `steps`, stacked by one `lax.scan`."""

    def body(x, _):
        y = step(x)
        return y, y

    _, tail = lax.scan(body, x0, length=steps)
    return tail


def with_first(x0: _State, tail: _State) -> _State:
    """`x0` put in front of the stack `tail`, leaf by leaf."""
    return jtu.tree_map(lambda a, b: jnp.concatenate([a[None], b]), x0, tail)
