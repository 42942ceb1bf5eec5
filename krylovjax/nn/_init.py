"""Parameter initialisation shared by the layers of `krylovjax.nn`.

The draws follow `equinox.nn.Linear`: for a complex dtype, the real and imaginary
parts are drawn independently, each from the real distribution.
"""

from typing import Any

import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, PRNGKeyArray


def uniform(key: PRNGKeyArray, shape: tuple[int, ...], dtype: Any, lim: float) -> Array:
    """Entries uniform in `[-lim, lim)`, in both parts if `dtype` is complex."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        real_dtype = jnp.finfo(dtype).dtype
        rkey, ikey = jr.split(key)
        real = jr.uniform(rkey, shape, real_dtype, minval=-lim, maxval=lim)
        imag = jr.uniform(ikey, shape, real_dtype, minval=-lim, maxval=lim)
        return real.astype(dtype) + 1j * imag.astype(dtype)
    return jr.uniform(key, shape, dtype, minval=-lim, maxval=lim)
