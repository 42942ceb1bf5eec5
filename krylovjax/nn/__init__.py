"""Equinox layers built on [`krylovjax.krylov`][].

- [`krylovjax.nn.LinearDynamics`][]: a learnable linear recurrence, unrolled.
- [`krylovjax.nn.StateSpaceConv`][]: a dense linear state-space sequence layer.
- [`krylovjax.nn.KrylovGraphConv`][]: a polynomial graph filter, with
  [`krylovjax.nn.normalise_adjacency`][].
- [`krylovjax.nn.ChebGraphConv`][]: the Chebyshev spectral graph convolution of
  PyTorch Geometric's `ChebConv`.
- [`krylovjax.nn.ChebIIConv`][]: ChebNetII's propagation, a graph filter learnt
  through its values at the Chebyshev nodes.
"""

from ._cheb_conv import ChebGraphConv as ChebGraphConv
from ._chebii_conv import ChebIIConv as ChebIIConv
from ._graph_conv import (
    KrylovGraphConv as KrylovGraphConv,
    normalise_adjacency as normalise_adjacency,
)
from ._linear_dynamics import LinearDynamics as LinearDynamics
from ._state_space import StateSpaceConv as StateSpaceConv

__all__ = [
    "ChebGraphConv",
    "ChebIIConv",
    "KrylovGraphConv",
    "LinearDynamics",
    "StateSpaceConv",
    "normalise_adjacency",
]
