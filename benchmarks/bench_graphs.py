r"""Polynomial graph filters on large sparse graphs: krylovjax against PyTorch and PyG.

A random undirected graph with `n` nodes and average degree `--degree` (15,
self-loops included), symmetrically normalised, $\hat A = D^{-1/2} (A + I)
D^{-1/2}$, and node features `X` of shape `(n, b)` (`b = 128`), float32, generated
by NumPy from `--seed`; every library gets the same arrays (JAX a BCOO matrix,
PyTorch a CSR tensor, PyG an `EdgeIndex` or `edge_index`/`edge_weight`). Cases
(`--cases`): `forward`, the stack `[X, ÂX, ..., Â^(d-1) X]` (d = 4); `grad_x`, its
gradient with respect to `X` of `sum(stack * W)` (`W` a fixed `(d, b)` array);
`grad_both`, the same with respect to `X` and the edge weights; `conv`, forward +
backward of `krylovjax.nn.KrylovGraphConv(128, 64, num_hops=3)` against PyG's
`TAGConv(128, 64, K=3, normalize=False)` with the same weights; `cheb_fwd` and
`cheb`, forward and forward + backward of `krylovjax.nn.ChebGraphConv(128, 64,
K=10)` against PyG's `ChebConv(128, 64, K=10)` (`"sym"`, `lambda_max=2`, the same
weights) on the graph's edges without self-loops, unit weights. Methods: krylovjax
(jitted), `torch_csr` (`torch.sparse.mm` in a loop), `pyg` (`EdgeIndex.matmul`),
for `conv` `pyg_csr` (TAGConv on the CSR tensor) and `pyg_ei` (TAGConv on
`edge_index`), and for `cheb_fwd`/`cheb` `pyg_cheb_csr` (ChebConv on an `EdgeIndex`
sorted by row) and `pyg_cheb_ei` (ChebConv on `edge_index`).
`benchmarks/README.md` ("Graph filters") has the details.

Two measurements, each in child processes of this script, whose own process
imports neither JAX nor torch (a child's `ru_maxrss` starts from its parent's RSS):

- **time**: the methods of one case interleaved in rounds in one process (one per
  case; `--quick`: all cases in one), median of `--repeats` rounds after a warm-up,
  outputs compared with krylovjax's; JAX's compile time and torch's first call
  are reported apart.
- **peak RSS**: every (method, case) in its own process (`--rss-case METHOD:CASE`,
  which prints its JSON report when run by hand), `ru_maxrss` at the end of two
  calls, nothing subtracted. The parent kills a child whose resident set passes
  `--rss-limit-gb` and reports "killed at X GB"; the RSS phase runs first, and a
  case killed there is left out of the timing.

Run `python benchmarks/bench_graphs.py` (n = 170000, every case but `cheb_fwd` and
`cheb`; about 6 minutes on 2 cores), `--cases cheb_fwd,cheb` (the ChebConv
comparison: PyG's ChebConv takes most of its half an hour), `--quick` (n = 5000,
RSS of `grad_both` only: under a minute), `--n 20000` (a small graph, for
regressions), or `--n 1000000 --cases forward,grad_both --phases rss` (the 1M-node
memory targets). PyTorch and PyG are optional
(`pip install -e ".[bench-torch]"`): without them their cells read "not
installed". Results go to `--out` (default `benchmarks/out/graphs`, git-ignored):
`results.json`, `results.md`, and `rss/` and `timing/` (each child's JSON report
and stderr).
"""

import argparse
import gc
import importlib.util
import json
import resource
import sys
import time
import warnings
from pathlib import Path

import _harness as h
import numpy as np

CASES = ("forward", "grad_x", "grad_both", "conv", "filter", "cheb_fwd", "cheb")
METHODS = {case: ("krylovjax", "torch_csr", "pyg") for case in CASES[:3]}
METHODS["conv"] = ("krylovjax", "pyg_csr", "pyg_ei")
METHODS["filter"] = ("krylovjax", "materialising", "pyg")
CHEB_CASES = ("cheb_fwd", "cheb")
# What runs without `--cases`: PyG's ChebConv alone takes half an hour at 170k.
DEFAULT_CASES = tuple(x for x in CASES if x not in CHEB_CASES)
METHODS |= {case: ("krylovjax", "pyg_cheb_csr", "pyg_cheb_ei") for case in CHEB_CASES}
LABELS = {"krylovjax": "krylovjax", "torch_csr": "torch CSR", "pyg": "PyG EdgeIndex"}
LABELS["materialising"] = "krylovjax, krylov stack"
LABELS |= {"pyg_csr": "PyG TAGConv CSR", "pyg_ei": "PyG TAGConv edge_index"}
LABELS |= {"pyg_cheb_csr": "PyG ChebConv CSR", "pyg_cheb_ei": "PyG ChebConv edge_index"}
PYG = ("pyg", "pyg_csr", "pyg_ei", "pyg_cheb_csr", "pyg_cheb_ei")
# The libraries each method needs, by import name.
NEEDS = {"krylovjax": ("jax", "krylovjax"), "torch_csr": ("torch",)}
NEEDS["materialising"] = NEEDS["krylovjax"]
NEEDS |= {m: ("torch", "torch_geometric") for m in PYG}
# The targets, shown next to the numbers (not checked).
TIME_TARGETS = {case: "kj / torch CSR <= 1.2 at n = 170k" for case in CASES[:2]}
TIME_TARGETS["grad_both"] = "completes; see the RSS target"
TIME_TARGETS["conv"] = "kj / TAGConv CSR <= 1 at n = 170k"
TIME_TARGETS["filter"] = "kj / krylov stack <= 1.2 where both fit"
TIME_TARGETS |= {c: "kj / ChebConv CSR <= 0.8 at n = 170k" for c in CHEB_CASES}
RSS_TARGETS = {"forward": "<= 6 GB at n = 1M", "grad_x": "-", "conv": "-"}
RSS_TARGETS["filter"] = "<= 6 GB at n = 1M, filter depth 16"
RSS_TARGETS["grad_both"] = "<= 1.5x grad_x at 170k; <= 6 GB at n = 1M"
RSS_TARGETS |= {case: "-" for case in CHEB_CASES}
# Largest relative difference from krylovjax's outputs that counts as agreeing
# (float32; ChebConv's K = 10 blocks are a three-term recurrence).
AGREE_RTOL = 1e-4


# The graph: NumPy only, so that every library gets the same arrays.


def make_graph(
    n: int,
    degree: int,
    b: int,
    d: int,
    conv_out: int,
    seed: int,
    cheb_k: int = 10,
    filter_d: int = 16,
):
    """A random undirected graph with self-loops, its normalised weights, features.

    `(degree - 1) * n // 2` distinct undirected edges `{i, j}`, `i != j`, drawn
    uniformly, stored both ways, plus the `n` self-loops: about `degree` entries per
    row. The entries are sorted by (row, column) so that the BCOO order, the CSR
    order and the `EdgeIndex` order are the same, and the gradients of the values
    line up. Also the weights of the two layers: `KrylovGraphConv` (`d` blocks) and
    `ChebGraphConv` (`cheb_k` blocks), both `b` features in and `conv_out` out;
    and the filter's `filter_d` coefficients `theta`.
    """
    rng = np.random.default_rng(seed)
    m = (degree - 1) * n // 2
    keys = np.empty(0, np.int64)
    while keys.size < m:
        need = m - keys.size
        i = rng.integers(0, n, size=need + need // 50 + 16, dtype=np.int64)
        j = rng.integers(0, n, size=i.size, dtype=np.int64)
        keep = i != j
        lo, hi = np.minimum(i, j)[keep], np.maximum(i, j)[keep]
        keys = np.unique(np.concatenate([keys, lo * n + hi]))
    if keys.size > m:
        keys = keys[np.sort(rng.permutation(keys.size)[:m])]
    lo, hi = (keys // n).astype(np.int32), (keys % n).astype(np.int32)
    del keys
    loops = np.arange(n, dtype=np.int32)
    rows = np.concatenate([lo, hi, loops])
    cols = np.concatenate([hi, lo, loops])
    del lo, hi, loops
    order = np.argsort(rows.astype(np.int64) * n + cols, kind="stable")
    rows, cols = rows[order], cols[order]
    del order
    counts = np.bincount(rows, minlength=n)
    deg = counts.astype(np.float64)  # unit weights, self-loop included
    values = (1.0 / np.sqrt(deg[rows] * deg[cols])).astype(np.float32)
    crow = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=crow[1:])
    X = rng.standard_normal((n, b), dtype=np.float32)
    W = rng.standard_normal((d, b), dtype=np.float32)
    V = rng.standard_normal((conv_out,), dtype=np.float32)
    # KrylovGraphConv's initialisation (uniform, fan-in d * b), as NumPy arrays so
    # that TAGConv gets the same weights.
    lim = 1 / np.sqrt(d * b)
    conv_weight = rng.uniform(-lim, lim, (conv_out, d * b)).astype(np.float32)
    conv_bias = rng.uniform(-lim, lim, (conv_out,)).astype(np.float32)
    # ChebGraphConv's and ChebConv's weight initialisation (Glorot uniform), and a
    # bias that is not zero, so that its gradient is compared too.
    lim = np.sqrt(6 / (b + conv_out))
    cheb_weight = rng.uniform(-lim, lim, (cheb_k, b, conv_out)).astype(np.float32)
    cheb_bias = rng.uniform(-lim, lim, (conv_out,)).astype(np.float32)
    g = {"n": n, "nnz": int(rows.size), "rows": rows, "cols": cols, "crow": crow}
    g.update(values=values, X=X, W=W, V=V)
    g.update(cheb_weight=cheb_weight, cheb_bias=cheb_bias)
    g["theta"] = (rng.standard_normal(filter_d) / filter_d).astype(np.float32)
    return g | {"conv_weight": conv_weight, "conv_bias": conv_bias}


def graph_edges(g: dict) -> tuple[np.ndarray, np.ndarray]:
    """The rows and columns of the graph's edges without its self-loops: the
    adjacency $A$ (unit weights) that `ChebGraphConv` and `ChebConv` normalise
    themselves (both would drop the self-loops), sorted by (row, column)."""
    keep = g["rows"] != g["cols"]
    return g["rows"][keep], g["cols"][keep]


# One setup per library: it returns `call` (one run, finished, returning the
# outputs) and `extract` (the outputs as named NumPy arrays, to check agreement).


def jax_setup(fn, args, names) -> dict:
    """`fn` compiled for `args`: its call, its outputs as NumPy arrays named by
    `names`, the compile time and XLA's compiled memory."""
    import jax

    compiled, compile_s = h.compile_timed(fn, args)

    def extract(out):
        leaves = jax.tree.leaves(out)
        return {k: np.asarray(v) for k, v in zip(names, leaves, strict=True)}

    call = h.ready(compiled, args)
    return {"call": call, "extract": extract, "compile_s": compile_s} | {
        "xla": h.memory(compiled)
    }


def setup_krylovjax(case: str, g: dict, d: int) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.experimental import sparse

    import krylovjax
    from krylovjax.nn import KrylovGraphConv

    n = g["n"]
    data = jnp.asarray(g["values"])
    indices = jnp.asarray(np.stack([g["rows"], g["cols"]], axis=1))
    X, W = jnp.asarray(g["X"]), jnp.asarray(g["W"])

    def bcoo(data, indices):
        return sparse.BCOO((data, indices), shape=(n, n))

    def stack(data, indices, X):
        return krylovjax.krylov(bcoo(data, indices), X, d)

    def loss(data, indices, X, W):
        return jnp.sum(stack(data, indices, X) * W)

    args = (data, indices, X, W)
    if case == "forward":
        fn, args, names = stack, args[:3], ("stack",)
    elif case == "grad_x":
        fn, names = jax.grad(loss, argnums=2), ("X",)
    elif case == "grad_both":
        fn, names = jax.grad(loss, argnums=(0, 2)), ("values", "X")
    else:
        model = KrylovGraphConv(X.shape[1], g["V"].size, d - 1, key=jax.random.key(0))
        weights = jnp.asarray(g["conv_weight"]), jnp.asarray(g["conv_bias"])
        model = eqx.tree_at(lambda m: (m.weight, m.bias), model, weights)

        def conv_loss(model, data, indices, X, V):
            return jnp.sum(model(bcoo(data, indices), X) * V)

        def fn(model, data, indices, X, V):
            vg = jax.value_and_grad(conv_loss, argnums=(0, 3))
            value, (grad_model, grad_X) = vg(model, data, indices, X, V)
            return value, grad_X, grad_model.weight, grad_model.bias

        args = (model, data, indices, X, jnp.asarray(g["V"]))
        names = ("loss", "X", "weight", "bias")
    return jax_setup(fn, args, names)


def setup_krylovjax_cheb(case: str, g: dict) -> dict:
    """`ChebGraphConv` on the BCOO adjacency of unit weights, `lambda_max=2`:
    its output (`cheb_fwd`), or the loss `sum(out * V)` and its gradient with
    respect to the layer and `X` (`cheb`)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.experimental import sparse

    from krylovjax.nn import ChebGraphConv

    n = g["n"]
    rows, cols = graph_edges(g)
    data = jnp.ones(rows.shape, jnp.float32)
    indices = jnp.asarray(np.stack([rows, cols], axis=1))
    X, V = jnp.asarray(g["X"]), jnp.asarray(g["V"])
    K, b, out = g["cheb_weight"].shape
    model = ChebGraphConv(b, out, K, normalization="sym", key=jax.random.key(0))
    weights = jnp.asarray(g["cheb_weight"]), jnp.asarray(g["cheb_bias"])
    model = eqx.tree_at(lambda m: (m.weight, m.bias), model, weights)

    def forward(model, data, indices, X):
        A = sparse.BCOO((data, indices), shape=(n, n))
        return model(A, X, lambda_max=2.0)

    def loss(model, data, indices, X, V):
        return jnp.sum(forward(model, data, indices, X) * V)

    def grad(model, data, indices, X, V):
        vg = jax.value_and_grad(loss, argnums=(0, 3))
        value, (grad_model, grad_X) = vg(model, data, indices, X, V)
        return value, grad_X, grad_model.weight, grad_model.bias

    if case == "cheb_fwd":
        fn, args, names = forward, (model, data, indices, X), ("out",)
    else:
        fn, args = grad, (model, data, indices, X, V)
        names = ("loss", "X", "weight", "bias")
    return jax_setup(fn, args, names)


def setup_krylovjax_filter(g: dict, materialise: bool) -> dict:
    """The filter sum_k theta_k Â^k X by `polynomial_action`, or
    (`materialise`) as the `krylov` stack contracted with `theta`; the gradient of
    `sum(out * w)` (`w` the first row of `W`) with respect to the edge weights,
    `X` and `theta`."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import sparse

    import krylovjax

    n = g["n"]
    data = jnp.asarray(g["values"])
    indices = jnp.asarray(np.stack([g["rows"], g["cols"]], axis=1))
    X, theta, w = jnp.asarray(g["X"]), jnp.asarray(g["theta"]), jnp.asarray(g["W"][0])

    def loss(data, X, theta, indices, w):
        A = sparse.BCOO((data, indices), shape=(n, n))
        if materialise:
            out = krylovjax.krylov(A, X, theta.size, layout="rows")
            out = jnp.tensordot(theta, out, 1)
        else:
            out = krylovjax.polynomial_action(A, X, theta)
        return jnp.sum(out * w)

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
    args = (data, X, theta, indices, w)
    return jax_setup(fn, args, ("loss", "values", "X", "theta"))


def setup_pyg_filter(g: dict) -> dict:
    """The filter of `setup_krylovjax_filter` with PyG's `EdgeIndex.matmul` in a
    loop, differentiated by torch's autograd."""
    import torch
    from torch_geometric import EdgeIndex

    n = g["n"]
    edge_index = torch.from_numpy(np.stack([g["rows"], g["cols"]]).astype(np.int64))
    ei = EdgeIndex(edge_index, sparse_size=(n, n), sort_order="row", is_undirected=True)
    values = torch.from_numpy(g["values"]).requires_grad_()
    X = torch.from_numpy(g["X"]).requires_grad_()
    theta = torch.from_numpy(g["theta"]).requires_grad_()
    w = torch.from_numpy(g["W"][0])

    def call():
        x, out = X, theta[0] * X
        for k in range(1, theta.numel()):
            x = ei.matmul(x, input_value=values)
            out = out + theta[k] * x
        loss = (out * w).sum()
        return loss.detach(), *torch.autograd.grad(loss, [values, X, theta])

    def extract(out):
        keys = ("loss", "values", "X", "theta")
        return {k: t.numpy() for k, t in zip(keys, out, strict=True)}

    return {"call": call, "extract": extract}


def setup_pyg_cheb(method: str, case: str, g: dict) -> dict:
    """PyG's `ChebConv` with the same weights, `normalization="sym"`,
    `lambda_max=2`, on `edge_index` with unit `edge_weight`: as an `EdgeIndex`
    sorted by row (`pyg_cheb_csr`) or a plain tensor (`pyg_cheb_ei`). It takes no
    CSR tensor (`get_laplacian` indexes its input as `edge_index`), and its
    `get_laplacian` appends the self-loops to the edges, so the `EdgeIndex` leaves
    it unsorted and both forms propagate by gather and scatter."""
    import torch
    from torch_geometric import EdgeIndex
    from torch_geometric.nn import ChebConv

    n = g["n"]
    rows, cols = graph_edges(g)
    edge_index = torch.from_numpy(np.stack([rows, cols]).astype(np.int64))
    if method == "pyg_cheb_csr":
        edge_index = EdgeIndex(
            edge_index, sparse_size=(n, n), sort_order="row", is_undirected=True
        )
    edge_weight = torch.ones(rows.shape, dtype=torch.float32)
    K, b, out = g["cheb_weight"].shape
    conv = ChebConv(b, out, K=K, normalization="sym")
    with torch.no_grad():
        for k, lin in enumerate(conv.lins):
            lin.weight.copy_(torch.from_numpy(g["cheb_weight"][k].T))
        conv.bias.copy_(torch.from_numpy(g["cheb_bias"]))
    X, V = torch.from_numpy(g["X"]), torch.from_numpy(g["V"])

    def forward(x):
        return conv(x, edge_index, edge_weight, lambda_max=2.0)

    if case == "cheb_fwd":

        def call():
            with torch.no_grad():
                return (forward(X),)

        def extract(out):
            return {"out": out[0].numpy()}

        return {"call": call, "extract": extract}

    Xg, params = X.clone().requires_grad_(), [*conv.parameters()]

    def call():
        loss = (forward(Xg) * V).sum()
        return loss.detach(), *torch.autograd.grad(loss, [Xg, *params])

    def extract(out):
        loss, gx, *gp = (t.numpy() for t in out)
        names = [k for k, _ in conv.named_parameters()]  # the order of `params`
        by_name = dict(zip(names, gp, strict=True))
        weight = np.stack([by_name[f"lins.{k}.weight"].T for k in range(K)])
        return {"loss": loss, "X": gx, "weight": weight, "bias": by_name["bias"]}

    return {"call": call, "extract": extract}


def setup_torch(method: str, case: str, g: dict, d: int) -> dict:
    import torch

    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
    n = g["n"]
    values, X = torch.from_numpy(g["values"]), torch.from_numpy(g["X"])
    crow = torch.from_numpy(g["crow"])
    cols = torch.from_numpy(g["cols"].astype(np.int64))
    edge_index = torch.from_numpy(np.stack([g["rows"], g["cols"]]).astype(np.int64))

    def csr(v):
        return torch.sparse_csr_tensor(crow, cols, v, (n, n), check_invariants=False)

    if case == "conv":
        from torch_geometric.nn import TAGConv

        b = X.shape[1]
        conv = TAGConv(b, g["V"].size, K=d - 1, normalize=False)
        weight = torch.from_numpy(g["conv_weight"])
        with torch.no_grad():
            for k, lin in enumerate(conv.lins):
                lin.weight.copy_(weight[:, k * b : (k + 1) * b])
            conv.bias.copy_(torch.from_numpy(g["conv_bias"]))
        V, Xg, params = (
            torch.from_numpy(g["V"]),
            X.clone().requires_grad_(),
            [*conv.parameters()],
        )
        adj = (csr(values),) if method == "pyg_csr" else (edge_index, values)

        def call():
            loss = (conv(Xg, *adj) * V).sum()
            return loss.detach(), *torch.autograd.grad(loss, [Xg, *params])

        def extract(out):
            loss, gx, *gp = (t.numpy() for t in out)
            names = [k for k, _ in conv.named_parameters()]  # the order of `params`
            by_name = dict(zip(names, gp, strict=True))
            lins = [by_name[f"lins.{k}.weight"] for k in range(len(conv.lins))]
            weight = np.concatenate(lins, axis=1)
            return {"loss": loss, "X": gx, "weight": weight, "bias": by_name["bias"]}

        return {"call": call, "extract": extract}

    if method == "torch_csr":

        def product(v):
            A = csr(v)
            return lambda x: torch.sparse.mm(A, x)

    else:
        from torch_geometric import EdgeIndex

        ei = EdgeIndex(
            edge_index, sparse_size=(n, n), sort_order="row", is_undirected=True
        )

        def product(v):
            return lambda x: ei.matmul(x, input_value=v)

    def stack(v, x):
        mm, xs = product(v), [x]
        for _ in range(d - 1):
            xs.append(mm(xs[-1]))
        return torch.stack(xs, dim=1)

    # What the gradient is taken with respect to; the forward pass takes none.
    names = {"forward": (), "grad_x": ("X",), "grad_both": ("values", "X")}[case]
    inputs = {"values": values, "X": X}
    inputs |= {k: inputs[k].clone().requires_grad_() for k in names}
    W = torch.from_numpy(g["W"])

    def call():
        if not names:
            with torch.no_grad():
                return (stack(values, X),)
        loss = (stack(inputs["values"], inputs["X"]) * W).sum()
        return torch.autograd.grad(loss, [inputs[k] for k in names])

    def extract(out):
        keys = names or ("stack",)
        return {k: t.detach().numpy() for k, t in zip(keys, out, strict=True)}

    return {"call": call, "extract": extract}


def setup(method: str, case: str, g: dict, d: int) -> dict:
    if case in CHEB_CASES:
        if method == "krylovjax":
            return setup_krylovjax_cheb(case, g)
        return setup_pyg_cheb(method, case, g)
    if case == "filter":
        if method == "pyg":
            return setup_pyg_filter(g)
        return setup_krylovjax_filter(g, materialise=method == "materialising")
    if method == "krylovjax":
        return setup_krylovjax(case, g, d)
    return setup_torch(method, case, g, d)


def available(method: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in NEEDS[method])


def set_torch_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def child_info() -> dict:
    """Threads and devices, as the libraries a child imported see them."""
    info: dict = {}
    if "torch" in sys.modules:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        info["torch_interop_threads"] = torch.get_num_interop_threads()
    if "torch_geometric" in sys.modules:
        import torch_geometric.typing

        info["pyg_with_torch_sparse"] = bool(torch_geometric.typing.WITH_TORCH_SPARSE)
    if "jax" in sys.modules:
        import jax

        info["jax_backend"] = jax.default_backend()
        info["jax_device"] = str(jax.devices()[0])
    return info


# The children: peak RSS of one (method, case), or the timing of some cases. Each
# leaves its JSON report in `--child-json` (what it knows so far, if killed).


def set_address_space_backstop(args) -> None:
    """`RLIMIT_AS` at the limit plus `--rss-headroom-gb`, a backstop only: it counts
    address space, of which JAX's CPU runtime holds 1.3 to 3.2 GB beyond its peak
    RSS (n = 170k), so the limit itself is on the resident set (`run_child`)."""
    if args.rss_limit_gb > 0:
        cap = int((args.rss_limit_gb + args.rss_headroom_gb) * h.GB)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def checkpoint(args, report: dict) -> None:
    if args.child_json:
        Path(args.child_json).write_text(json.dumps(report) + "\n")


def finish_child(args, report: dict, code: int) -> int:
    report.update(info=child_info(), peak_rss=h.maxrss_bytes())
    status = h.proc_status()
    report.update(vm_peak=status.get("VmPeak"), vm_hwm=status.get("VmHWM"))
    if args.child_json:
        checkpoint(args, report)
    else:
        print(json.dumps(report), flush=True)
    return code


def build_graph(args, report: dict) -> dict:
    start = time.perf_counter()
    g = make_graph(
        args.n,
        args.degree,
        args.b,
        args.d,
        args.conv_out,
        args.seed,
        args.cheb_k,
        args.filter_d,
    )
    report["nnz"] = g["nnz"]
    report["graph_build_s"] = time.perf_counter() - start
    return g


def rss_child(args) -> int:
    """Run one (method, case) twice and report its peak RSS (`ru_maxrss`)."""
    method, case = args.rss_case.split(":")
    set_address_space_backstop(args)
    report: dict = {"method": method, "case": case, "n": args.n}
    try:
        # Only the library this method needs is imported.
        if method in ("krylovjax", "materialising"):
            import jax  # noqa: F401

            import krylovjax  # noqa: F401
        else:
            set_torch_threads(args.torch_threads)
            if method != "torch_csr":
                import torch_geometric  # noqa: F401
        report["rss_after_import"] = h.maxrss_bytes()
        g = build_graph(args, report)
        # The peak so far: the import and the graph's generation in NumPy.
        report["rss_after_graph"] = h.maxrss_bytes()
        checkpoint(args, report)
        s = setup(method, case, g, args.d)
        del g
        gc.collect()
        # The graph and features in the library's own arrays, the NumPy copies
        # dropped (for JAX also the compiled function: compile ran in `setup`).
        report["rss_after_setup"] = h.maxrss_bytes()
        report["rss_now_after_setup"] = h.proc_status().get("VmRSS")
        report["compile_s"] = s.get("compile_s")
        report["xla"] = s.get("xla")
        checkpoint(args, report)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            out = s["call"]()
            times.append(time.perf_counter() - start)
            del out
        report["call_s"] = times
        code = 0
    except Exception as e:
        # Under RLIMIT_AS NumPy raises MemoryError, torch a RuntimeError ("can't
        # allocate memory"), JAX a JaxRuntimeError "RESOURCE_EXHAUSTED".
        report["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        code = 3
    return finish_child(args, report, code)


def timing_child(args) -> int:
    """Time the methods of each case, interleaved (see `time_case`)."""
    set_address_space_backstop(args)
    skip = set(args.skip.split(",")) if args.skip else set()
    report: dict = {"n": args.n, "timing": {}}
    try:
        plan = {
            case: [
                m for m in METHODS[case] if available(m) and f"{m}:{case}" not in skip
            ]
            for case in args.timing_cases.split(",")
            if case
        }
        if any(m != "krylovjax" for ms in plan.values() for m in ms):
            set_torch_threads(args.torch_threads)
        g = build_graph(args, report)
        for case, methods in plan.items():
            if methods:
                report["timing"][case] = time_case(case, methods, g, args)
        code = 0
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        code = 3
    return finish_child(args, report, code)


def child_args(args, n: int) -> list[str]:
    names = ("degree", "b", "d", "conv_out", "cheb_k", "filter_d", "seed", "repeats")
    names += ("torch_threads",)
    names += ("rss_limit_gb", "rss_headroom_gb")
    flags = [(f"--{k.replace('_', '-')}", str(getattr(args, k))) for k in names]
    return ["--n", str(n), *(x for flag in flags for x in flag)]


def time_case(case: str, methods: list[str], g: dict, args) -> dict:
    """Set up every method and call each once, then time them side by side:
    `--repeats` interleaved rounds, each calling every method as many times as take
    about 50 ms (1 to 50). The first call's outputs are compared with krylovjax's.
    """
    calls, reference, results = {}, None, {}
    for method in methods:
        try:
            s = setup(method, case, g, args.d)
            start = time.perf_counter()
            out = s["call"]()
        except Exception as error:  # noqa: BLE001 (reported in its cell)
            # A method that cannot run this case (PyTorch's CSR gradient of the
            # values asks for a dense n x n array) is reported, the others timed.
            results[method] = h.failure(error)
            print(f"  time {method:>10} {case:<9} {results[method]}", flush=True)
            gc.collect()
            continue
        first = time.perf_counter() - start
        extracted = s["extract"](out)
        del out
        if method == "krylovjax":  # the first, where it runs
            reference = extracted
        agreement = None
        if method != "krylovjax" and reference is not None:
            agreement = h.largest_difference(extracted, reference)
        del extracted
        results[method] = {"compile_s": s.get("compile_s"), "first_call_s": first}
        results[method] |= {"xla": s.get("xla"), "agreement_vs_krylovjax": agreement}
        calls[method] = s["call"]
    del reference
    gc.collect()
    rounds = {"min_rounds": args.repeats, "max_rounds": args.repeats}
    timed = h.time_interleaved([*calls.values()], batch_s=0.05, max_batch=50, **rounds)
    for method, t in zip(calls, timed, strict=True):
        r = results[method] | t
        results[method] = r
        line = f"  time {method:>10} {case:<9} median {r['median_s'] * 1e3:9.1f} ms"
        if r["compile_s"] is not None:
            line += f"  compile {r['compile_s']:.2f} s"
        else:
            line += f"  first call {r['first_call_s'] * 1e3:.1f} ms"
        if r["agreement_vs_krylovjax"] is not None:
            line += f"  rel. diff vs krylovjax {r['agreement_vs_krylovjax']:.1e}"
        print(line, flush=True)
    return results


# Reporting.


def _ms(x):
    # Whole milliseconds from 1 s up (ChebConv's calls take tens of seconds).
    return h.fmt(None if x is None else x * 1e3, ".4g" if x is None or x < 1 else ".0f")


def ok_peak(r):
    return r["peak_rss"] if isinstance(r, dict) and "killed" not in r else None


def rss_cell(r) -> str:
    if r is None or isinstance(r, str):
        return r or "-"
    if "killed" in r:
        return r["killed"].split(" (")[0]
    return f"{h.gb(r['peak_rss'])} (after setup {h.gb(r.get('rss_after_setup'))})"


def time_row(case: str, rs: dict, others: tuple[str, str]) -> list:
    def med(meth):
        r = rs.get(meth)
        return r.get("median_s") if isinstance(r, dict) else None

    def cell(meth):
        r = rs.get(meth)
        return "-" if r is None else r if isinstance(r, str) else _ms(r["median_s"])

    def diff(meth):
        r = rs.get(meth)
        return (
            h.fmt(r.get("agreement_vs_krylovjax"), ".1e")
            if isinstance(r, dict)
            else "-"
        )

    kj = rs.get("krylovjax")
    compile_s = kj.get("compile_s") if isinstance(kj, dict) else None
    return (
        [case, cell("krylovjax"), cell(others[0]), cell(others[1])]
        + [h.fmt(h.ratio(med("krylovjax"), med(x))) for x in others]
        + [h.fmt(compile_s), ", ".join(map(diff, others)), TIME_TARGETS[case]]
    )


def cheb_lines(report: dict) -> list[str]:
    """The `ChebGraphConv` table: time and peak RSS of each method side by side."""
    timing, rss = report.get("timing") or {}, report.get("rss") or {}
    cases = [x for x in CHEB_CASES if x in timing or x in rss]
    if not cases:
        return []
    c = report["config"]
    others = METHODS["cheb"][1:]
    rows = []
    for case in cases:
        row = time_row(case, timing.get(case, {}), others)
        diffs = [timing.get(case, {}).get(x) for x in others]
        diffs = [r.get("agreement_vs_krylovjax") for r in diffs if isinstance(r, dict)]
        agree = "-" if not diffs or None in diffs else max(diffs) <= AGREE_RTOL
        agree = {True: "yes", False: "**no**"}.get(agree, agree)
        peaks = [rss_cell(rss.get(case, {}).get(x)) for x in METHODS[case]]
        rows.append([*row[:-1], agree, *peaks, row[-1]])
    what = {"cheb_fwd": "forward", "cheb": "forward + backward"}
    lines = [
        "",
        f"`ChebGraphConv({c['b']}, {c['conv_out']}, K={c['cheb_k']})` against PyG's "
        f"`ChebConv({c['b']}, {c['conv_out']}, K={c['cheb_k']})`, "
        '`normalization="sym"`, `lambda_max=2`, the same weights, on the graph\'s '
        "edges without self-loops and unit weights (both layers build the "
        "Laplacian in every call): "
        + "; ".join(f"`{x}` {what[x]}" for x in cases)
        + " (the loss `sum(out * V)`, gradient with respect to the layer and `X`). "
        "ChebConv CSR: an `EdgeIndex` sorted by row; edge_index: a plain tensor. "
        f"`agree`: largest rel. diff <= {AGREE_RTOL:g}. Peak RSS in GB, each "
        "(method, case) in its own process (the RSS table below).",
        "",
        *h.table(
            "case | ChebGraphConv ms | ChebConv CSR ms | ChebConv edge_index ms "
            "| kj / ChebConv CSR | kj / ChebConv edge_index | kj compile s "
            "| rel. diff CSR, edge_index | agree | peak RSS ChebGraphConv "
            "| peak RSS ChebConv CSR | peak RSS ChebConv edge_index | target (issue)",
            rows,
        ),
    ]
    return lines


def filter_lines(report: dict) -> list[str]:
    """The polynomial filter's table: time and peak RSS of each method."""
    timing = (report.get("timing") or {}).get("filter", {})
    rss = (report.get("rss") or {}).get("filter", {})
    if not timing and not rss:
        return []
    c = report["config"]
    row = time_row("filter", timing, ("materialising", "pyg"))
    peaks = [rss_cell(rss.get(x)) for x in METHODS["filter"]]
    return [
        "",
        f"Polynomial filter: `polynomial_action(A, X, theta)`, "
        f"sum_k theta_k Â^k X for k < {c['filter_d']}, against the same from the "
        "`krylov` stack contracted with `theta` (materialising) and PyG's "
        "`EdgeIndex.matmul` in a loop under autograd; value and gradient of "
        "`sum(out * w)` with respect to the edge weights, `X` and `theta`. Peak RSS "
        "in GB, each method in its own process.",
        "",
        *h.table(
            "case | polynomial_action ms | krylov stack ms | PyG EdgeIndex ms "
            "| kj / stack | kj / PyG | kj compile s | rel. diff stack, PyG "
            "| peak RSS polynomial_action | peak RSS stack | peak RSS PyG "
            "| target (issue)",
            [[*row[:-1], *peaks, f"{row[-1]}; {RSS_TARGETS['filter']}"]],
        ),
    ]


def markdown(report: dict) -> str:
    m, c = report["machine"], report["config"]
    v = m["versions"]
    lines = [
        "# Graph filters: krylovjax against PyTorch CSR and PyG",
        "",
        f"Command: `{m['command']}`",
        "",
        f"Graph: n = {c['n']}, nnz = {report['graph']['nnz']} (average degree "
        f"{report['graph']['nnz'] / c['n']:.2f}, self-loops included), b = {c['b']}, "
        f"d = {c['d']}, conv out = {c['conv_out']}, seed {c['seed']}, float32; built "
        f"in {h.fmt(report['graph']['build_s'], '.1f')} s (NumPy, in each process).",
        "",
        f"Versions: python {m['python']}, numpy {v['numpy']}, jax {v['jax']}, jaxlib "
        f"{v['jaxlib']}, equinox {v['equinox']}, krylovjax {v['krylovjax']} (commit "
        f"`{m['git_commit']}`), torch {v['torch']}, torch_geometric "
        f"{v['torch_geometric']} (torch_sparse {v['torch_sparse']}, torch_scatter "
        f"{v['torch_scatter']}).",
        "",
        f"Threads: {m['cores']} cores available to the process (os.cpu_count() "
        f"{m['cpu_count']}); torch.set_num_threads({c['torch_threads']}) -> "
        f"{m.get('torch_threads', h.NOT_INSTALLED)} intra-op, "
        f"{m.get('torch_interop_threads', '-')} inter-op threads; XLA's CPU client "
        f"uses its default thread pool (all cores); XLA_FLAGS={m['XLA_FLAGS']!r}, "
        f"OMP_NUM_THREADS={m['OMP_NUM_THREADS']!r}. {m['platform']}.",
        "",
    ]
    timing = report.get("timing")
    if timing:
        lines += [
            "## Time",
            "",
            f"Median of {c['repeats']} interleaved rounds, ms per call (JAX: jitted, "
            "compile excluded). Ratios are krylovjax / the other. `rel. diff`: "
            "largest |difference| / largest |value| of the outputs against "
            "krylovjax's.",
        ]
        rows = [
            time_row(case, timing[case], ("torch_csr", "pyg"))
            for case in ("forward", "grad_x", "grad_both")
            if case in timing
        ]
        if rows:
            lines += [
                "",
                *h.table(
                    "case | krylovjax ms | torch CSR ms | PyG EdgeIndex ms "
                    "| kj / torch CSR | kj / PyG | kj compile s "
                    "| rel. diff torch, PyG | target (issue)",
                    rows,
                ),
            ]
        if "conv" in timing:
            lines += [
                "",
                *h.table(
                    "case | KrylovGraphConv ms | TAGConv CSR ms | TAGConv edge_index "
                    "ms | kj / TAGConv CSR | kj / TAGConv edge_index | kj compile s "
                    "| rel. diff CSR, edge_index | target (issue)",
                    [time_row("conv", timing["conv"], ("pyg_csr", "pyg_ei"))],
                ),
            ]
        lines += cheb_lines(report) + filter_lines(report)
        first = [
            f"{case} {LABELS[meth]} {_ms(r.get('first_call_s'))}"
            for case, rs in timing.items()
            for meth, r in rs.items()
            if meth != "krylovjax" and isinstance(r, dict) and "median_s" in r
        ]
        peaks = [
            f"{case} {h.gb(rs['process']['peak_rss'])}"
            for case, rs in timing.items()
            if "process" in rs
        ]
        lines += [
            "",
            f"First calls of the torch methods (ms): {', '.join(first) or 'none ran'}.",
            "",
            f"Peak RSS of the timing processes (GB): {', '.join(peaks)}.",
            "",
        ]
    rss = report.get("rss")
    if rss:
        lines += [
            "## Peak RSS",
            "",
            "Each (method, case) in its own process: `ru_maxrss` at the end of two "
            "calls (compile included), in GB, nothing subtracted; `after setup`: "
            "`ru_maxrss` once the graph and features are in the library's arrays "
            f"(and, for JAX, the function compiled). Limit {c['rss_limit_gb']:g} GB "
            "on the resident set. Every `ru_maxrss` includes the RSS of the parent "
            f"process when it started the child, {h.gb(c['parent_rss_at_start'])} "
            "GB (Linux keeps the high-water mark across fork and exec).",
            "",
        ]
        rows = []
        rest = (*CHEB_CASES, "filter")
        for case in (x for x in CASES if x in rss and x not in rest):
            rs = rss[case]
            others = METHODS[case][1:]
            cells = [rss_cell(rs.get(x)) for x in ("krylovjax", *others)]
            kj_over = h.ratio(ok_peak(rs.get("krylovjax")), ok_peak(rs.get(others[0])))
            rows.append([case, *cells, h.fmt(kj_over), RSS_TARGETS[case]])
        if rows:
            lines += h.table(
                "case | krylovjax | torch CSR / TAGConv CSR | PyG EdgeIndex / TAGConv "
                "edge_index | kj / torch CSR (conv: / TAGConv CSR) | target (issue)",
                rows,
            )
        if not report.get("timing"):
            lines += cheb_lines(report) + filter_lines(report)
        if "grad_x" in rss and "grad_both" in rss:
            parts = [
                f"{LABELS[x]} "
                + h.fmt(
                    h.ratio(
                        ok_peak(rss["grad_both"].get(x)), ok_peak(rss["grad_x"].get(x))
                    )
                )
                for x in ("krylovjax", "torch_csr", "pyg")
            ]
            lines += [
                "",
                "Peak RSS of grad_both / grad_x (target for krylovjax: <= 1.5): "
                f"{', '.join(parts)}.",
            ]
        rows = []
        for case, rs in rss.items():
            for meth, r in rs.items():
                if isinstance(r, str):
                    rows.append([LABELS[meth], case, r, *[""] * 10])
                    continue
                xla = r.get("xla") or {}
                after = r.get("rss_after_setup")
                rows.append(
                    [LABELS[meth], case]
                    + [h.gb(r.get(k)) for k in ("rss_after_import", "rss_after_graph")]
                    + [h.gb(after), h.gb(r.get("rss_now_after_setup"))]
                    + [r.get("killed") or h.gb(r["peak_rss"])]
                    + [h.gb(None if after is None else r["peak_rss"] - after)]
                    + [h.gb(r.get("vm_peak")), h.gb(xla.get("temp_bytes"))]
                    + [h.gb(xla.get("output_bytes")), h.fmt(r.get("compile_s"))]
                    + [h.fmt((r.get("call_s") or [None])[-1])]
                )
        lines += [
            "",
            "Details, in GB: `after graph`: `ru_maxrss` right after the graph and "
            "features were generated in NumPy (the import included); `after setup`: "
            "after they were handed to the library and the NumPy copies dropped "
            "(for JAX: and the function compiled), and the RSS at that moment; "
            "`virtual`: VmPeak, the address space; `XLA temp`/`XLA out`: the "
            "compiled function's temporary and output buffers; `call s`: the second "
            "call in the RSS process, a rough single timing.",
            "",
            *h.table(
                "method | case | after import | after graph | after setup "
                "| RSS now after setup | peak | peak - after setup | virtual "
                "| XLA temp | XLA out | compile s | call s",
                rows,
            ),
        ]
    n, nnz, b, d = c["n"], report["graph"]["nnz"], c["b"], c["d"]
    blocks = ""
    if any(x in c["cases"] for x in CHEB_CASES):
        K = c["cheb_k"]
        blocks = f"ChebGraphConv's K blocks (n, K, b) {4 * n * K * b / h.GB:.3f} GB, "
    lines += [
        "",
        f"Sizes for orientation: X {4 * n * b / h.GB:.3f} GB, the stack (n, d, b) "
        f"{4 * n * d * b / h.GB:.3f} GB, {blocks}one gathered (nnz, b) array "
        f"{4 * nnz * b / h.GB:.3f} GB, the BCOO matrix {12 * nnz / h.GB:.3f} GB, the "
        f"CSR matrix {(12 * nnz + 8 * n) / h.GB:.3f} GB. Total run time "
        f"{report['total_s']:.0f} s.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    out = Path(__file__).parent / "out" / "graphs"
    for flag, kind, default, text in (
        ("--n", int, 170_000, "nodes (170000)"),
        ("--degree", int, 15, "average degree, self-loop included"),
        ("--b", int, 128, "features per node"),
        ("--d", int, 4, "blocks X ... Â^(d-1) X"),
        ("--conv-out", int, 64, "output features of the layers"),
        ("--cheb-k", int, 10, "K of ChebGraphConv and ChebConv"),
        ("--filter-d", int, 16, "terms of the polynomial filter (case filter)"),
        ("--seed", int, 0, None),
        (
            "--cases",
            str,
            ",".join(DEFAULT_CASES),
            f"comma-separated, of {', '.join(CASES)} (default: all but the cheb ones)",
        ),
        ("--phases", str, "rss,timing", "comma-separated, of rss and timing"),
        ("--repeats", int, 5, "timing rounds"),
        ("--torch-threads", int, h.cores(), "default: the cores we may use"),
        ("--rss-limit-gb", float, 8.0, "kill a child whose RSS passes it (0: none)"),
        ("--rss-headroom-gb", float, 8.0, "a child's RLIMIT_AS: the limit plus it"),
        ("--out", Path, out, "output folder (default benchmarks/out/graphs)"),
    ):
        parser.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="n = 5000, 3 rounds, all cases timed in one process, RSS of grad_both "
        "only: a smoke run",
    )
    # The children (run by hand, they print their JSON report): one (method, case)
    # for peak RSS, `--rss-case METHOD:CASE`; or the timing of some cases.
    for flag in ("--rss-case", "--timing-cases", "--skip", "--child-json"):
        parser.add_argument(flag, help=argparse.SUPPRESS)  # --skip METHOD:CASE,...
    args = parser.parse_args(argv)
    h.cpu_by_default()  # for the children too: JAX is imported only there
    if args.rss_case:
        sys.exit(rss_child(args))
    if args.timing_cases:
        sys.exit(timing_child(args))

    cases = [x for x in args.cases.split(",") if x]
    phases = [x for x in args.phases.split(",") if x]
    bad = [x for x in cases if x not in CASES] + [
        x for x in phases if x not in ("rss", "timing")
    ]
    if bad:
        parser.error(f"unknown case or phase: {', '.join(bad)}")
    n = 5000 if args.quick else args.n
    if args.quick:
        args.repeats = 3
    args.out.mkdir(parents=True, exist_ok=True)
    log = h.Log()
    dists = ("numpy", "equinox", "torch", "torch_geometric")
    machine = h.machine_info(*dists, "torch_sparse", "torch_scatter")
    machine["torch_threads_requested"] = args.torch_threads
    log(f"command: {machine['command']}")
    log(
        "versions: "
        + ", ".join(f"{k} {v}" for k, v in machine["versions"].items())
        + f"; python {machine['python']}"
    )
    log(
        f"threads: {machine['cores']} cores; torch.set_num_threads("
        f"{args.torch_threads}); XLA: its default thread pool"
    )
    config = {k: getattr(args, k) for k in ("degree", "b", "d", "conv_out", "seed")}
    config["cheb_k"], config["filter_d"] = args.cheb_k, args.filter_d
    config |= {"n": n, "cases": cases, "phases": phases, "repeats": args.repeats}
    config |= {k: getattr(args, k) for k in ("torch_threads", "rss_limit_gb")}
    config |= {"rss_headroom_gb": args.rss_headroom_gb, "quick": args.quick}
    config["parent_rss_at_start"] = h.maxrss_bytes()
    report: dict = {"machine": machine, "config": config}
    script = [sys.executable, str(Path(__file__).resolve())]
    children = []

    rss: dict = {}
    if "rss" in phases:
        log("peak RSS, one process per (method, case)")
        rss_cases = [c for c in cases if c == "grad_both"] if args.quick else cases
        for case in rss_cases:
            rss[case] = {}
            for method in METHODS[case]:
                if not available(method):
                    rss[case][method] = h.NOT_INSTALLED
                    continue
                cmd = [*script, "--rss-case", f"{method}:{case}", *child_args(args, n)]
                path = args.out / "rss" / f"{method}_{case}.json"
                r = h.run_child(cmd, path, args.rss_limit_gb, True)
                rss[case][method] = r
                children.append(r)
                done = "killed" not in r and (
                    f"peak {r['peak_rss'] / h.GB:6.2f} GB, after setup "
                    f"{r['rss_after_setup'] / h.GB:5.2f} GB, "
                    f"call {r['call_s'][-1]:7.2f} s"
                )
                log(f"  rss {method:>10} {case:<9} {done or r['killed']}")
        report["rss"] = rss

    if "timing" in phases:
        log("time, the methods of each case interleaved in one process")
        timing: dict = {}
        skip = []
        for case in cases:
            timing[case] = {}
            for method in METHODS[case]:
                r = rss.get(case, {}).get(method)
                if not available(method):
                    timing[case][method] = h.NOT_INSTALLED
                elif isinstance(r, dict) and "killed" in r:
                    skip.append(f"{method}:{case}")
                    what = r["killed"].split(" (")[0]
                    timing[case][method] = f"skipped ({what} in its RSS run)"
        groups = [cases] if args.quick else [[c] for c in cases]
        for group in groups:
            cmd = [*script, "--timing-cases", ",".join(group), *child_args(args, n)]
            if skip:
                cmd += ["--skip", ",".join(skip)]
            name = "_".join(group)
            r = h.run_child(
                cmd, args.out / "timing" / f"{name}.json", args.rss_limit_gb, False
            )
            children.append(r)
            for case in group:
                timing[case].update(r.get("timing", {}).get(case, {}))
                timing[case]["process"] = {
                    k: r.get(k) for k in ("command", "peak_rss", "killed", "wall_s")
                }
                if "killed" in r:
                    log(f"  timing of {case}: {r['killed']}")
                    for method in METHODS[case]:
                        timing[case].setdefault(method, "timing process " + r["killed"])
        report["timing"] = timing

    for r in children:
        machine.update(r.get("info", {}))
    built = [r for r in children if "nnz" in r]
    report["graph"] = {
        "nnz": built[0]["nnz"] if built else n + 2 * ((args.degree - 1) * n // 2),
        "build_s": built[0].get("graph_build_s") if built else None,
    }
    report["total_s"] = log.elapsed()
    text = markdown(report)
    h.write_results(args.out, report, text)
    print()
    print(text)
    log(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
