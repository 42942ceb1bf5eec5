"""krylovjax: Krylov matrices and iterated maps in JAX, with lean gradients."""

import importlib.metadata

from ._iterate import iterate as iterate
from ._krylov import krylov as krylov

__all__ = ["iterate", "krylov"]

__version__ = importlib.metadata.version("krylovjax")
