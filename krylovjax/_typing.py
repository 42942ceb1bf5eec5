"""Type aliases for the public signatures.

They are jaxtyping annotations, so a runtime checker (jaxtyping's import hook with
beartype, as the test suite runs) checks dtypes and shapes, and shape names bind
across the arguments of one call: the `n` of a matrix `A` is the `n` of `x0`. They
say what each function accepts; the functions also validate their arguments
themselves, with messages that name the argument, for callers that run without a
checker.
"""

from collections.abc import Callable
from typing import TypeAlias

import numpy as np
from jax.experimental import sparse
from jaxtyping import Array, Inexact, Integer

OperatorLike: TypeAlias = (
    Inexact[Array | np.ndarray, "n n"]
    | Inexact[sparse.BCOO, "n n"]
    | Callable[[Inexact[Array, "n ..."]], Inexact[Array, "n ..."]]
)
"""What [`krylovjax.krylov`][] accepts as the operator `A`.

One of: a square floating-point or complex `(n, n)` array (JAX or NumPy); a
two-dimensional `jax.experimental.sparse.BCOO` matrix of that kind; or a linear
callable mapping arrays of `x0`'s shape and dtype to arrays of the same shape and
dtype (a function that closes over arrays, an `equinox.Module`, a bound method such
as `lineax_operator.mv`).
"""

StaticInt: TypeAlias = int | np.integer | Integer[Array | np.ndarray, ""]
"""A size or count that fixes an array shape: a Python or NumPy integer, or a
0-dimensional integer array.

It must be concrete: a traced value (an argument of a `jax.jit`-ted function that is
not marked static) raises a `TypeError`, and so does a `bool`.
"""
