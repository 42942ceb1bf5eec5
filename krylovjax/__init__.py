"""krylovjax: Krylov matrices and iterated maps in JAX, with lean gradients."""

import importlib.metadata

from . import nn as nn
from ._arnoldi import Arnoldi as Arnoldi, arnoldi as arnoldi
from ._bases import (
    AbstractBasis as AbstractBasis,
    Chebyshev as Chebyshev,
    Jacobi as Jacobi,
    Legendre as Legendre,
    ThreeTerm as ThreeTerm,
)
from ._block import (
    BlockArnoldi as BlockArnoldi,
    BlockLanczos as BlockLanczos,
    block_arnoldi as block_arnoldi,
    block_lanczos as block_lanczos,
)
from ._funm import FunmInfo as FunmInfo, funm_action as funm_action
from ._iterate import iterate as iterate
from ._krylov import auto_method as auto_method, krylov as krylov
from ._lanczos import Lanczos as Lanczos, lanczos as lanczos
from ._partition import (
    GraphPartition as GraphPartition,
    PartitionedOperator as PartitionedOperator,
    partition_graph as partition_graph,
)
from ._readout import (
    krylov_readout as krylov_readout,
    polynomial_action as polynomial_action,
)
from ._spectrum import spectrum_interval as spectrum_interval
from ._trace import TraceInfo as TraceInfo, trace_funm as trace_funm
from ._typing import OperatorLike as OperatorLike, StaticInt as StaticInt

__all__ = [
    "AbstractBasis",
    "Arnoldi",
    "BlockArnoldi",
    "BlockLanczos",
    "Chebyshev",
    "FunmInfo",
    "GraphPartition",
    "Jacobi",
    "Lanczos",
    "Legendre",
    "OperatorLike",
    "PartitionedOperator",
    "StaticInt",
    "ThreeTerm",
    "TraceInfo",
    "arnoldi",
    "auto_method",
    "block_arnoldi",
    "block_lanczos",
    "funm_action",
    "iterate",
    "krylov",
    "krylov_readout",
    "lanczos",
    "nn",
    "partition_graph",
    "polynomial_action",
    "spectrum_interval",
    "trace_funm",
]

__version__ = importlib.metadata.version("krylovjax")
