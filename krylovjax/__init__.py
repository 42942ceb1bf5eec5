"""krylovjax: Krylov matrices and iterated maps in JAX, with lean gradients."""

import importlib.metadata

from . import nn as nn
from ._iterate import iterate as iterate
from ._krylov import auto_method as auto_method, krylov as krylov
from ._typing import OperatorLike as OperatorLike, StaticInt as StaticInt

__all__ = ["OperatorLike", "StaticInt", "auto_method", "iterate", "krylov", "nn"]

__version__ = importlib.metadata.version("krylovjax")
