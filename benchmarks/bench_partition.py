"""Benchmark the halo-exchange `PartitionedOperator` against the Explicit-mesh BCOO.

`krylovjax.partition_graph(A, P).operator(mesh)` applies a sparse matrix split by
rows over `P` devices, each product moving only the rows of `x` that another
device's rows read (`lax.ppermute`, one per shift). Today's alternative is a BCOO
matrix whose stored entries (sorted by row) are split over an `Explicit` mesh with
`x` split by rows (`docs/multi_device.md`, "A graph partitioned by rows"): each
product all-gathers `x` and reduce-scatters the partial sums. Three parts, on
forced host devices (`--xla_force_host_platform_device_count=8`), float32:

- **Bytes per product**, read from the compiled HLO (compiled only, never run, so
  n = 1M is fine): `krylov(A, x0, 2)`, exactly one product, for the halo operator
  and for the BCOO matrix, `x0` of `b = 64` columns, on a 1000 x 1000 grid (natural
  and RCM order) and on a planted-partition graph numbered at random (RCM and the
  community-sorted order), at P = 4 and 8. Also the halo rows and
  `GraphPartition.bytes_per_product`, which must equal the HLO count.
- **Agreement**: the same graphs at n = 40k, `krylov(A, x0, 4)` and its gradient
  (edge values and `x0`) of `sum(sin(K))`, halo against BCOO, in float32 and
  float64 (the float64 check runs last, after `jax_enable_x64` is switched on).
- **Time**, 4 devices: `KrylovGraphConv(64, 64, num_hops=4)` on a grid, the forward
  pass and the value and gradient of `sum(sin(out))` with respect to the features,
  the layer and the edge values, the two paths timed side by side; with the bytes
  each whole program moves (collectives inside loops counted once per iteration).
- **The matrix powers kernel**, 4 devices: `krylov(op, x0, 17)` and its gradient
  with `operator(mesh, steps=s)` for s = 2, 4, 8 against `steps=1`: bytes per
  product from the compiled HLO, time as ratios side by side.

Run `python benchmarks/bench_partition.py --docs` (about twelve minutes on 2 cores;
the docs tables), `--powers-only` (the last part, about eight minutes) or `--quick`
(small sizes, about a minute). Results go to `--out`
(default `benchmarks/out/partition`, git-ignored): `results.json` and
`results.md`; `--docs` also writes the tables to `docs/benchmarks/partition.md`.
"""

import os
import re

# Forced host devices, before JAX is imported (an existing count is kept).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import time
from functools import partial
from pathlib import Path

import _harness as h

h.cpu_by_default()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import sparse  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import krylovjax  # noqa: E402
from krylovjax.nn import KrylovGraphConv  # noqa: E402

FULL = {
    "bytes": {"side": 1000, "planted_n": 1_000_000, "b": 64, "parts": (4, 8)},
    "check": {"side": 200, "planted_n": 40_000, "b": 8, "d": 4, "parts": (4, 8)},
    "time": {"side": 500, "b": 64, "hops": 4, "parts": 4},
    "powers": {"side": 500, "b": 64, "d": 17, "parts": 4, "steps": (2, 4, 8)},
    "timing": {"target_s": 3.0, "min_rounds": 5, "max_rounds": 30},
}
QUICK = {
    "bytes": {"side": 200, "planted_n": 40_000, "b": 64, "parts": (4, 8)},
    "check": {"side": 40, "planted_n": 1600, "b": 8, "d": 4, "parts": (4, 8)},
    "time": {"side": 100, "b": 16, "hops": 4, "parts": 4},
    "powers": {"side": 100, "b": 16, "d": 9, "parts": 4, "steps": (2, 4)},
    "timing": {"target_s": 0.1, "min_rounds": 3, "max_rounds": 5},
}
COMMUNITIES = 16
DEGREE = 10  # average number of neighbours of the planted-partition graph
INSIDE = 0.95  # fraction of its edges inside a community
# Ratio of bytes (BCOO / halo) the issue asks of locality-preserving orders.
BYTES_TARGET = 5.0


# The graphs: NumPy only. Each is `(rows, cols, values, n)`, entries sorted by
# (row, column), the symmetric normalised adjacency with self-loops,
# D^-1/2 (A + I) D^-1/2 (on the grid's interior every weight is 1/5).


def normalised(lo: np.ndarray, hi: np.ndarray, n: int, dtype) -> tuple:
    """The undirected edges `{lo, hi}` (distinct, no loops) stored both ways, plus
    the self-loops, with the weights 1 / sqrt(deg_i deg_j), sorted by row."""
    loops = np.arange(n, dtype=np.int64)
    rows = np.concatenate([lo, hi, loops])
    cols = np.concatenate([hi, lo, loops])
    order = np.argsort(rows * n + cols, kind="stable")
    rows, cols = rows[order], cols[order]
    deg = np.bincount(rows, minlength=n).astype(np.float64)
    values = (1.0 / np.sqrt(deg[rows] * deg[cols])).astype(dtype)
    return rows.astype(np.int32), cols.astype(np.int32), values, n


def grid_graph(side: int, dtype=np.float32) -> tuple:
    """The 5-point stencil of a `side` x `side` grid, node `r * side + c`."""
    node = np.arange(side * side, dtype=np.int64).reshape(side, side)
    lo = np.concatenate([node[:, :-1].ravel(), node[:-1, :].ravel()])
    hi = np.concatenate([node[:, 1:].ravel(), node[1:, :].ravel()])
    return normalised(lo, hi, side * side, dtype)


def planted_graph(n: int, seed: int = 0, dtype=np.float32) -> tuple:
    """A planted-partition graph: `COMMUNITIES` equal communities, about `DEGREE`
    neighbours per node, a fraction `INSIDE` of the edges inside a community (the
    others to a uniformly drawn node of another community), nodes numbered at
    random. Returns the graph and the community-sorted order (a permutation with
    `order[p]` the node at position `p`: community after community)."""
    rng = np.random.default_rng(seed)
    size = n // COMMUNITIES
    n = size * COMMUNITIES
    m = DEGREE * n // 2
    keys = np.empty(0, np.int64)
    while keys.size < m:  # positions in the community-sorted numbering
        k = m - keys.size + 1024
        u = rng.integers(0, n, k)
        inside = rng.random(k) < INSIDE
        shift = np.where(inside, 0, rng.integers(1, COMMUNITIES, k))
        community = (u // size + shift) % COMMUNITIES
        v = community * size + rng.integers(0, size, k)
        keep = u != v
        lo, hi = np.minimum(u, v)[keep], np.maximum(u, v)[keep]
        keys = np.unique(np.concatenate([keys, lo * n + hi]))
    keys = keys[np.sort(rng.permutation(keys.size)[:m])]
    label = rng.permutation(n)  # node label of each position
    lo, hi = label[keys // n], label[keys % n]
    return normalised(lo, hi, n, dtype), label


def padded(rows, cols, values, n, multiple):
    """The BCOO arrays, padded with entries at `(n, n)` (outside the matrix, after
    the last row) to a multiple of `multiple` entries, as the Explicit-mesh path
    needs."""
    pad = -rows.size % multiple
    indices = np.stack([rows, cols], axis=1)
    indices = np.concatenate([indices, np.full((pad, 2), n, indices.dtype)])
    return np.concatenate([values, np.zeros(pad, values.dtype)]), indices


def bcoo(data, indices, n):
    return sparse.BCOO((data, indices), shape=(n, n), indices_sorted=True)


def device_counts(parts):
    """The device counts of `parts` that the forced host devices allow (an
    `XLA_FLAGS` set before the run may force fewer than 8)."""
    kept = [p for p in parts if p <= jax.device_count()]
    if not kept:
        msg = f"needs {min(parts)} devices; JAX has {jax.device_count()}"
        raise SystemExit(msg)
    return kept


def mesh_of(parts: int):
    return jax.make_mesh(
        (parts,), ("x",), devices=jax.devices()[:parts], axis_types=(AxisType.Explicit,)
    )


def scipy_matrix(rows, cols, values, n):
    from scipy.sparse import coo_matrix

    return coo_matrix((values, (rows, cols)), shape=(n, n))


# Bytes from the compiled HLO.

COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "collective-permute",
    "all-to-all",
)
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s([a-z][\w\-]*)\((.*)$"
)
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_CALLS = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _arrays(text: str) -> list[int]:
    """The byte sizes of the arrays named in an HLO type (a tuple has several)."""
    sizes = []
    for dtype, dims in _ARRAY.findall(text):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        sizes.append(count * _DTYPE_BYTES[dtype])
    return sizes


def _group_size(attrs: str, devices: int) -> int:
    """The devices per replica group: `{{0,1,2,3},...}`, `[G,S]<=[N]` (iota) or
    `mesh[...] {axes}`; the program's device count when none is given."""
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", attrs):
        return len(m.group(1).split(","))
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs):
        return int(m.group(2))
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        axes = re.findall(r"'([^']+)'", m.group(2))
        return int(np.prod([int(sizes[a]) for a in axes])) if axes else devices
    return devices


def collective_bytes(hlo: str, devices: int) -> dict:
    """The bytes that the collectives of a compiled SPMD program receive, summed
    over its `devices` devices (shapes in SPMD HLO are per device; a group has G
    devices):

    - collective-permute: output bytes x the number of (source, target) pairs;
    - all-gather: (output - input) bytes x `devices`;
    - reduce-scatter: (input - output) bytes x `devices`;
    - all-reduce: 2 (G - 1) / G x size x `devices` (a ring's reduce-scatter and
      all-gather);
    - all-to-all: size x (G - 1) / G x `devices`.

    The async forms (`-start`; `-done` ignored) count alike, their output the
    result tuple's arrays less the operands (and the `u32[]` contexts). An
    instruction in a `while` body counts once per iteration of its known trip
    count (nested loops multiply); one in a loop without a known trip count
    counts once and is listed under `unknown_trip_count`.

    Returns `total` and, per kind, `count` (instructions, times their trips) and
    `bytes`, and `unknown_trip_count`.
    """
    shapes: dict[str, list[int]] = {}
    found = []  # (computation, kind, result sizes, operand names, attributes, async)
    calls: dict[str, list[tuple[str, int | None]]] = {}
    entry, computation = None, None
    for line in hlo.splitlines():
        if m := _HEADER.match(line):
            computation = m.group(2)
            if m.group(1):
                entry = computation
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, result, op, rest = m.groups()
        shapes[name] = _arrays(result)
        operands, _, attrs = rest.partition(")")
        trip = None
        if op == "while":
            t = _TRIP.search(attrs)
            trip = int(t.group(1)) if t else None
        for key, callee in _CALLS.findall(attrs):
            calls.setdefault(computation, []).append(
                (callee, trip if key == "body" else 1)
            )
        for branches in _BRANCHES.findall(attrs):
            for callee in re.findall(r"%([\w.\-]+)", branches):
                calls.setdefault(computation, []).append((callee, 1))
        base = op.removesuffix("-start")
        if base in COLLECTIVES and not op.endswith("-done"):
            names = re.findall(r"%([\w.\-]+)", operands)
            found.append((computation, base, result, names, attrs, op != base))
    # How often each computation runs per call of the program.
    times = {entry: 1}
    unknown = set()
    stack = [entry]
    while stack:
        caller = stack.pop()
        for callee, trip in calls.get(caller, ()):
            if trip is None:
                unknown.add(callee)
            times[callee] = times.get(callee, 0) + times[caller] * (trip or 1)
            stack.append(callee)
    report = {kind: {"count": 0, "bytes": 0} for kind in COLLECTIVES}
    for comp, kind, result, names, attrs, is_async in found:
        n_in = sum(sum(shapes.get(x, [])) for x in names)
        sizes = _arrays(result)
        if is_async and result.lstrip().startswith("("):
            n_out = sum(s for s in sizes) - n_in
            n_out -= sum(4 for s in re.findall(r"\bu32\[\]", result))
        else:
            n_out = sum(sizes)
        group = _group_size(attrs, devices)
        if kind == "collective-permute":
            pairs = re.findall(
                r"\{(\d+),(\d+)\}", attrs.split("source_target_pairs=")[1]
            )
            moved = n_out * sum(1 for s, t in pairs if s != t)
        elif kind == "all-gather":
            moved = (n_out - n_in) * devices
        elif kind == "reduce-scatter":
            moved = (n_in - n_out) * devices
        elif kind == "all-reduce":
            moved = 2 * (group - 1) / group * n_out * devices
        else:  # all-to-all
            moved = n_out * (group - 1) / group * devices
        k = times.get(comp, 1)
        report[kind]["count"] += k
        report[kind]["bytes"] += int(round(moved)) * k
    return {
        "total": sum(v["bytes"] for v in report.values()),
        **report,
        "unknown_trip_count": sorted(unknown),
    }


def kinds(counted: dict) -> str:
    """The collectives of a `collective_bytes` report, e.g. "2 collective-permute"."""
    return ", ".join(
        f"{counted[k]['count']} {k}" for k in COLLECTIVES if counted[k]["count"]
    )


# Part 1: bytes per product at n = 1M, compiled only.


def one_product(A, x):
    return krylovjax.krylov(A, x, 2)


def halo_program(part, mesh, b):
    """The compiled `krylov(op, x0, 2)` of the halo operator (never run)."""
    spec = NamedSharding(mesh, P("x", None))
    with jax.set_mesh(mesh):
        op = part.operator(mesh)
        x = jax.ShapeDtypeStruct(
            (part.num_parts * part.n_local, b), jnp.float32, sharding=spec
        )
        return jax.jit(one_product).lower(op, x).compile()


def bcoo_program(nse, n, mesh, b, dtype=jnp.float32):
    """The compiled `krylov(A, x0, 2)` of the BCOO matrix on the Explicit mesh."""
    with jax.set_mesh(mesh):
        data = jax.ShapeDtypeStruct((nse,), dtype, sharding=NamedSharding(mesh, P("x")))
        idx = jax.ShapeDtypeStruct(
            (nse, 2), jnp.int32, sharding=NamedSharding(mesh, P("x", None))
        )
        x = jax.ShapeDtypeStruct(
            (n, b), dtype, sharding=NamedSharding(mesh, P("x", None))
        )
        fn = jax.jit(lambda data, idx, x: one_product(bcoo(data, idx, n), x))
        return fn.lower(data, idx, x).compile()


def graphs(config, dtype=np.float32):
    """The grid and the planted-partition graph, each with its orders to compare."""
    grid = grid_graph(config["side"], dtype)
    planted, label = planted_graph(config["planted_n"], dtype=dtype)
    return [
        (
            "grid",
            f"{config['side']} x {config['side']} grid",
            grid,
            [("natural", None), ("rcm", "rcm")],
        ),
        (
            "planted",
            f"planted partition, {COMMUNITIES} communities, random numbering",
            planted,
            [("rcm", "rcm"), ("communities", label)],
        ),
    ]


def run_bytes(config, log):
    b, out = config["b"], []
    for key, title, (rows, cols, values, n), orders in graphs(config):
        nse = rows.size + (-rows.size % 8)
        matrix = scipy_matrix(rows, cols, values, n)
        for parts in device_counts(config["parts"]):
            mesh = mesh_of(parts)
            start = time.perf_counter()
            explicit = collective_bytes(bcoo_program(nse, n, mesh, b).as_text(), parts)
            log(
                f"{key} P={parts} bcoo: {explicit['total']} bytes "
                f"({time.perf_counter() - start:.1f} s)"
            )
            for order_name, order in orders:
                start = time.perf_counter()
                part = krylovjax.partition_graph(matrix, parts, order=order)
                partition_s = time.perf_counter() - start
                halo = collective_bytes(halo_program(part, mesh, b).as_text(), parts)
                received = part.halo.sum(axis=1)
                case = {
                    "graph": key,
                    "title": title,
                    "n": n,
                    "nnz": int(rows.size),
                    "b": b,
                    "parts": parts,
                    "order": order_name,
                    "shifts": list(part.shifts),
                    "halo_rows_max": int(received.max()),
                    "halo_rows_total": int(received.sum()),
                    "rows_sent": part.bytes_per_product(1, np.int8),
                    "halo_bytes": halo["total"],
                    "halo_collectives": kinds(halo),
                    "bcoo_bytes": explicit["total"],
                    "bcoo_collectives": kinds(explicit),
                    "ratio": h.ratio(explicit["total"], halo["total"]),
                    "bytes_per_product": part.bytes_per_product(b, np.float32),
                    "partition_s": partition_s,
                    "halo_hlo": halo,
                    "bcoo_hlo": explicit,
                }
                case["cross_check"] = case["bytes_per_product"] == halo["total"]
                log(
                    f"{key} P={parts} {order_name}: halo {halo['total']} bytes, "
                    f"ratio {case['ratio']:.1f}, bytes_per_product "
                    f"{'==' if case['cross_check'] else '!='} HLO "
                    f"(partition {partition_s:.1f} s, total "
                    f"{time.perf_counter() - start:.1f} s)"
                )
                out.append(case)
    return out


# Part 2: the two paths agree.


def krylov_and_grad(A, x, d):
    K = krylovjax.krylov(A, x, d)
    return jnp.sum(jnp.sin(K)), K


@partial(jax.jit, static_argnames=("n", "d"))
def check_bcoo(data, indices, x, *, n, d):
    def f(data, x):
        return krylov_and_grad(bcoo(data, indices, n), x, d)

    (_, K), grads = jax.value_and_grad(f, (0, 1), has_aux=True)(data, x)
    return K, *grads


@partial(jax.jit, static_argnames=("d",))
def check_halo(values, x, op, *, d):
    def f(values, x):
        return krylov_and_grad(op.with_values(values), x, d)

    (_, K), grads = jax.value_and_grad(f, (0, 1), has_aux=True)(values, x)
    return K, *grads


def run_check(config, dtype, log):
    """`krylov(A, x0, d)` and the gradient of `sum(sin(K))` in the edge values and
    `x0`, halo operator against BCOO, on the graphs of `config` in `dtype`."""
    b, d, out = config["b"], config["d"], []
    for key, _, (rows, cols, values, n), orders in graphs(config, dtype):
        data, indices = padded(rows, cols, values, n, 8)
        x = np.random.default_rng(1).standard_normal((n, b)).astype(dtype)
        entries = jnp.asarray(np.stack([rows, cols], 1))
        matrix = sparse.BCOO((jnp.asarray(values), entries), shape=(n, n))

        for parts in device_counts(config["parts"]):
            mesh = mesh_of(parts)
            with jax.set_mesh(mesh):
                rows_spec = NamedSharding(mesh, P("x", None))
                dd = jax.device_put(data, NamedSharding(mesh, P("x")))
                ii = jax.device_put(indices, rows_spec)
                K, gv, gx = check_bcoo(dd, ii, jax.device_put(x, rows_spec), n=n, d=d)
                want = (np.asarray(K), np.asarray(gv)[: rows.size], np.asarray(gx))
                for order_name, order in orders:
                    part = krylovjax.partition_graph(matrix, parts, order=order)
                    op = part.operator(mesh)
                    xp = jax.device_put(part.to_partitioned(x), rows_spec)
                    K, gv, gx = check_halo(op.values, xp, op, d=d)
                    got = (
                        np.asarray(part.from_partitioned(K)),
                        np.asarray(part.from_partitioned_values(gv)),
                        np.asarray(part.from_partitioned(gx)),
                    )
                    diff = [
                        h.largest_difference(g, w)
                        for g, w in zip(got, want, strict=True)
                    ]
                    out.append(
                        {
                            "graph": key,
                            "n": n,
                            "b": b,
                            "d": d,
                            "parts": parts,
                            "order": order_name,
                            "dtype": np.dtype(dtype).name,
                            "krylov": diff[0],
                            "grad_values": diff[1],
                            "grad_x": diff[2],
                        }
                    )
                    log(
                        f"check {np.dtype(dtype).name} {key} P={parts} {order_name}: "
                        f"{max(diff):.1e}"
                    )
    return out


# Part 3: time a graph convolution, forward and gradient.


def run_time(config, timing, log):
    side, b, hops, parts = config["side"], config["b"], config["hops"], config["parts"]
    rows, cols, values, n = grid_graph(side)
    data, indices = padded(rows, cols, values, n, parts)
    mesh = mesh_of(parts)
    rng = np.random.default_rng(2)
    X = rng.standard_normal((n, b)).astype(np.float32)
    model = KrylovGraphConv(b, b, hops, key=jax.random.key(0))
    part = krylovjax.partition_graph(
        scipy_matrix(rows, cols, values, n), parts, order="rcm"
    )

    def loss(out):
        return jnp.sum(jnp.sin(out))

    def bcoo_forward(data, indices, X, model):
        return model(bcoo(data, indices, n), X)

    def halo_forward(values, X, model, op):
        return model(op.with_values(values), X)

    def bcoo_grad(data, indices, X, model):
        def f(data, X, model):
            return loss(bcoo_forward(data, indices, X, model))

        return jax.value_and_grad(f, (0, 1, 2))(data, X, model)

    def halo_grad(values, X, model, op):
        def f(values, X, model):
            return loss(halo_forward(values, X, model, op))

        return jax.value_and_grad(f, (0, 1, 2))(values, X, model)

    result = {"n": n, "nnz": int(rows.size), "b": b, "hops": hops, "parts": parts}
    result["shifts"] = list(part.shifts)
    result["halo_rows_max"] = int(part.halo.sum(axis=1).max())
    result["bytes_per_product"] = part.bytes_per_product(b, np.float32)
    with jax.set_mesh(mesh):
        rows_spec = NamedSharding(mesh, P("x", None))
        dd = jax.device_put(data, NamedSharding(mesh, P("x")))
        ii = jax.device_put(indices, rows_spec)
        xx = jax.device_put(X, rows_spec)
        op = part.operator(mesh)
        xp = jax.device_put(part.to_partitioned(X), rows_spec)
        # The same products with no exchange (entries reading halo rows drop out):
        # the time the exchanges take, all that an s-step exchange could save.
        local = krylovjax.PartitionedOperator(
            values=op.values,
            rows=op.rows,
            cols=op.cols,
            sends=(),
            pairs=(),
            mesh=op.mesh,
            axis=op.axis,
            n_local=op.n_local,
        )
        fns = {
            ("forward", "halo"): (halo_forward, (op.values, xp, model, op)),
            ("forward", "local"): (halo_forward, (op.values, xp, model, local)),
            ("forward", "bcoo"): (bcoo_forward, (dd, ii, xx, model)),
            ("grad", "halo"): (halo_grad, (op.values, xp, model, op)),
            ("grad", "bcoo"): (bcoo_grad, (dd, ii, xx, model)),
        }
        calls, outputs = {}, {}
        for name, (fn, args) in fns.items():
            compiled, compile_s = h.compile_timed(fn, args)
            counted = collective_bytes(compiled.as_text(), parts)
            calls[name] = h.ready(compiled, args)
            outputs[name] = jax.tree.map(np.asarray, calls[name]())
            result[" ".join(name)] = {
                "compile_s": compile_s,
                "bytes": counted["total"],
                "collectives": kinds(counted),
                "hlo": counted,
                **h.memory(compiled),
            }
            log(
                f"time {' '.join(name)}: compiled in {compile_s:.1f} s, "
                f"{counted['total']} bytes ({kinds(counted)})"
            )
        for mode in ("forward", "grad"):
            names = [(mode, "halo"), (mode, "bcoo")]
            names += [(mode, "local")] if mode == "forward" else []
            timed = h.time_interleaved([calls[k] for k in names], **timing)
            for k, t in zip(names, timed, strict=True):
                result[" ".join(k)].update(t)
            log(
                f"time {mode}: halo {timed[0]['median_s']:.3f} s, "
                f"bcoo {timed[1]['median_s']:.3f} s"
            )
    # Agreement: the halo outputs mapped back to the input numbering.
    fh, fb = outputs[("forward", "halo")], outputs[("forward", "bcoo")]
    result["forward_difference"] = h.largest_difference(part.from_partitioned(fh), fb)
    (lh, (gvh, gxh, gmh)), (lb, (gvb, gxb, gmb)) = (
        outputs[("grad", "halo")],
        outputs[("grad", "bcoo")],
    )
    result["grad_difference"] = {
        "loss": h.largest_difference(lh, lb),
        "values": h.largest_difference(
            part.from_partitioned_values(gvh), gvb[: rows.size]
        ),
        "X": h.largest_difference(part.from_partitioned(gxh), gxb),
        "layer": h.largest_difference(gmh, gmb),
    }
    result["exchange share"] = 1 - h.ratio(
        result["forward local"]["median_s"], result["forward halo"]["median_s"]
    )
    for mode in ("forward", "grad"):
        result[f"{mode} ratio"] = h.ratio(
            result[f"{mode} halo"]["median_s"], result[f"{mode} bcoo"]["median_s"]
        )
    return result


# Part 4: the matrix powers kernel, `steps` products per exchange.


def run_powers(config, timing, log):
    """`krylov(op, x0, d)` and the value and gradient of `sum(sin(K))` in the edge
    values and `x0`, with `operator(mesh, steps=s)` for each `s`, against one
    exchange per product (`steps=1`, with its default rule and with
    `adjoint="autodiff"`, the derivatives `steps > 1` uses)."""
    side, b, d, parts = config["side"], config["b"], config["d"], config["parts"]
    rows, cols, values, n = grid_graph(side)
    mesh = mesh_of(parts)
    part = krylovjax.partition_graph(
        scipy_matrix(rows, cols, values, n), parts, order="rcm"
    )
    X = np.random.default_rng(3).standard_normal((n, b)).astype(np.float32)

    def forward(values, x, op, adjoint):
        return krylovjax.krylov(op.with_values(values), x, d, adjoint=adjoint)

    def grad(values, x, op, adjoint):
        def f(values, x):
            return jnp.sum(jnp.sin(forward(values, x, op, adjoint)))

        return jax.value_and_grad(f, (0, 1))(values, x)

    variants = [(1, None), (1, "autodiff")] + [(s, None) for s in config["steps"]]
    result = {"n": n, "nnz": int(rows.size), "b": b, "d": d, "parts": parts}
    result["cases"] = []
    with jax.set_mesh(mesh):
        rows_spec = NamedSharding(mesh, P("x", None))
        xp = jax.device_put(part.to_partitioned(X), rows_spec)
        calls, outputs = {}, {}
        for steps, adjoint in variants:
            op = part.operator(mesh, steps=steps)
            case = {
                "steps": steps,
                "adjoint": adjoint or "default",
                "bytes_per_exchange": part.bytes_per_exchange(b, np.float32, steps),
            }
            for mode, fn in (("forward", forward), ("grad", grad)):
                args = (op.values, xp, op)
                compiled, compile_s = h.compile_timed(
                    partial(fn, adjoint=adjoint), args
                )
                counted = collective_bytes(compiled.as_text(), parts)
                calls[(mode, steps, adjoint)] = h.ready(compiled, args)
                outputs[(mode, steps, adjoint)] = jax.tree.map(
                    np.asarray, calls[(mode, steps, adjoint)]()
                )
                case[mode] = {
                    "compile_s": compile_s,
                    "bytes": counted["total"],
                    "collectives": kinds(counted),
                    **h.memory(compiled),
                }
                log(
                    f"powers steps={steps} {adjoint} {mode}: {counted['total']} "
                    f"bytes ({kinds(counted)}), compiled in {compile_s:.1f} s"
                )
            result["cases"].append(case)
        for mode in ("forward", "grad"):
            names = [(mode, s, a) for s, a in variants]
            timed = h.time_interleaved([calls[k] for k in names], **timing)
            base = timed[0]["median_s"]
            for case, t, k in zip(result["cases"], timed, names, strict=True):
                case[mode].update(t)
                case[mode]["ratio"] = h.ratio(t["median_s"], base)
                case[mode]["difference"] = h.largest_difference(
                    outputs[k], outputs[names[0]]
                )
            log(
                f"powers {mode}: "
                + ", ".join(
                    f"steps={c['steps']} {c['adjoint']} {c[mode]['ratio']:.2f}"
                    for c in result["cases"]
                )
            )
    return result


# Output.


def mib(n_bytes):
    if n_bytes is None:
        return "-"
    x = n_bytes / 2**20
    return format(x, ".3g") if x < 100 else format(x, ",.0f")


def msec(seconds):
    x = seconds * 1e3
    return format(x, ".3g") if x < 100 else format(x, ",.0f")


def markdown(report):
    m, cases = report["machine"], report["bytes"]
    b = cases[0]["b"]
    lines = [
        f"Bytes received per product, summed over the devices, from the compiled HLO "
        f"of `krylov(A, x0, 2)` (one product; compiled, not run), `x0` of "
        f"{b} columns, float32. *halo*: `partition_graph(A, P, order=...)."
        f'operator(mesh)`; *BCOO*: the entries sorted by row and split `P("x")` '
        f'over an `Explicit` mesh, `x0` split `P("x", None)` (the same for every '
        f"order). Halo rows: the rows a device needs from the others per product "
        f"(the largest over the devices, and the sum); rows sent: what the "
        f"`ppermute`s carry, each shift's buffer padded to its largest halo on every "
        f"device (the wrap-around pairs of a non-periodic order included).",
        "",
    ]
    rows = []
    for c in cases:
        rows.append(
            (
                c["title"],
                f"{c['n']:,}",
                c["parts"],
                f"`{c['order']}`",
                len(c["shifts"]),
                f"{c['halo_rows_max']:,}",
                f"{c['halo_rows_total']:,}",
                f"{c['rows_sent']:,}",
                mib(c["halo_bytes"]),
                mib(c["bcoo_bytes"]),
                f"**{h.fmt(c['ratio'], '.1f')}**",
                f"{c['bytes_per_product']:,}",
                "yes" if c["cross_check"] else f"**no** (HLO {c['halo_bytes']:,})",
            )
        )
    lines += h.table(
        "graph | n | P | order | shifts | halo rows (max) | halo rows (total) "
        "| rows sent | halo MiB | BCOO MiB | BCOO / halo | `bytes_per_product` "
        "| = halo HLO",
        rows,
        "lrrlrrrrrrrrl",
    )
    collectives = {(c["graph"], c["parts"]): c["bcoo_collectives"] for c in cases}
    halo_kinds = sorted({c["halo_collectives"] for c in cases})
    lines += [
        "",
        f"Target: BCOO / halo >= {BYTES_TARGET:g} for a locality-preserving order. "
        "Collectives in the programs: BCOO "
        + "; ".join(f"{g} P={p}: {v}" for (g, p), v in collectives.items())
        + "; halo: "
        + "; ".join(halo_kinds)
        + ". The planted-partition graph has all its nodes numbered at random and "
        "5% of its edges between random communities, so its breadth-first levels "
        "grow fast and reverse Cuthill-McKee does not recover the communities: "
        "`rcm` there is not a locality-preserving order, and its halo is most of "
        "the graph; the community-sorted order is.",
        "",
        "**How the bytes are counted** (`collective_bytes` in "
        "`benchmarks/bench_partition.py`). Shapes in the SPMD HLO are per device; "
        "every collective is counted as the bytes received, summed over the P "
        "devices (G devices per replica group): collective-permute, its output "
        "bytes times the number of (source, target) pairs; all-gather, (output - "
        "input) bytes times P; reduce-scatter, (input - output) bytes times P; "
        "all-reduce, 2 (G - 1) / G times its size times P (a ring's reduce-scatter "
        "and all-gather); all-to-all, its size times (G - 1) / G times P. Async "
        "`-start` forms count alike (`-done` is skipped); an instruction inside a "
        "`while` loop counts once per iteration of its known trip count. "
        "`GraphPartition.bytes_per_product(b)` counts the padded halo buffers (one per "
        "device and shift), and must equal the halo program's count.",
        "",
    ]
    checks = report["check"]
    lines += [
        f"Agreement, n = {checks[0]['n']:,} grid and planted graph at n = "
        f"{next(c['n'] for c in checks if c['graph'] == 'planted'):,}, "
        f"b = {checks[0]['b']}: `krylov(A, x0, {checks[0]['d']})` and the gradient of "
        "`sum(sin(K))` in the edge values and `x0`, halo against BCOO (the largest "
        "difference over the largest entry):",
        "",
        *h.table(
            "dtype | graph | P | order | Krylov matrix | grad values | grad x0",
            [
                (
                    c["dtype"],
                    c["graph"],
                    c["parts"],
                    f"`{c['order']}`",
                    h.fmt(c["krylov"], ".1e"),
                    h.fmt(c["grad_values"], ".1e"),
                    h.fmt(c["grad_x"], ".1e"),
                )
                for c in checks
            ],
            "llrlrrr",
        ),
        "",
    ]
    t = report["time"]
    side = int(round(t["n"] ** 0.5))
    lines += [
        f"Time, {t['parts']} host devices on {m['cores']} cores: "
        f"`KrylovGraphConv({t['b']}, {t['b']}, num_hops={t['hops']})` on a "
        f"{side} x {side} grid (n = {t['n']:,}, {t['nnz']:,} entries, RCM order for "
        f"the halo operator: {len(t['shifts'])} shifts, at most "
        f"{t['halo_rows_max']:,} halo rows per device), float32; *grad* is the value "
        "and gradient of `sum(sin(out))` in the features, the layer and the edge "
        "values. The halo operator takes the features in its partitioned numbering "
        "(converted once, outside the timed function), the BCOO path in the input "
        "numbering; both on the same `Explicit` mesh inside `jax.set_mesh`. Bytes: "
        "the whole compiled program's collectives, counted as above. Median of "
        "interleaved rounds (`benchmarks/_harness.py`).",
        "",
    ]
    rows = []
    labels = {"forward": "forward", "grad": "forward + gradient"}
    for mode in ("forward", "grad"):
        halo, explicit = t[f"{mode} halo"], t[f"{mode} bcoo"]
        rows.append(
            (
                labels[mode],
                msec(halo["median_s"]),
                msec(explicit["median_s"]),
                f"**{h.fmt(t[f'{mode} ratio'])}**",
                mib(halo["bytes"]),
                mib(explicit["bytes"]),
                h.fmt(h.ratio(explicit["bytes"], halo["bytes"]), ".1f"),
            )
        )
    lines += h.table(
        "pass | halo (ms) | BCOO (ms) | halo / BCOO | halo MiB | BCOO MiB "
        "| BCOO / halo bytes",
        rows,
        "lrrrrrr",
    )
    g = t["grad_difference"]
    lines += [
        "",
        "Target: halo / BCOO <= 1.0. Collectives: forward halo "
        f"{t['forward halo']['collectives']}, BCOO {t['forward bcoo']['collectives']}; "
        f"gradient halo {t['grad halo']['collectives']}, BCOO "
        f"{t['grad bcoo']['collectives']}. Largest relative differences, halo against "
        f"BCOO: output {h.fmt(t['forward_difference'], '.1e')}, loss "
        f"{h.fmt(g['loss'], '.1e')}, gradient of the edge values "
        f"{h.fmt(g['values'], '.1e')}, of the features {h.fmt(g['X'], '.1e')}, of the "
        f"layer {h.fmt(g['layer'], '.1e')}.",
        "",
        "What the exchanges cost: the forward pass with the same products and no "
        f"exchange takes {msec(t['forward local']['median_s'])} ms against "
        f"{msec(t['forward halo']['median_s'])} ms, so the exchanges are "
        f"{100 * t['exchange share']:.0f}% of it on these host devices, where a "
        "collective-permute is a copy in memory. That is the most that fewer "
        "exchanges can save here (the matrix powers kernel's own measurement is in "
        "`partition_powers.md`).",
        "",
        f"jax {m['versions']['jax']}, {m['backend']}, {m['cores']} cores, "
        f"XLA_FLAGS={m['XLA_FLAGS']!r}, {m['time']}; the run took "
        f"{report['wall_s'] / 60:.1f} min.",
        "",
    ]
    return "\n".join(lines)


def powers_markdown(p, machine, wall_s):
    side = int(round(p["n"] ** 0.5))
    lines = [
        f"The matrix powers kernel (`part.operator(mesh, steps=s)`: halos s hops "
        f"deep, one exchange per s products), {p['parts']} host devices: "
        f"`krylov(op, x0, {p['d']})` on a {side} x {side} grid (RCM order), `x0` of "
        f"{p['b']} columns, float32, and the value and gradient of `sum(sin(K))` in "
        "the edge values and `x0`. *bytes / product*: the whole program's "
        f"collectives over its {p['d'] - 1} products (the values' one exchange "
        "included); time as the ratio to `steps=1` with its default rule, timed "
        "side by side. `steps > 1` differentiates with JAX's rules through its "
        'blocks, so `steps=1` with `adjoint="autodiff"` is shown too.',
        "",
    ]
    rows = []
    for c in p["cases"]:
        f, g = c["forward"], c["grad"]
        rows.append(
            (
                c["steps"],
                f"`{c['adjoint']}`",
                f"{c['bytes_per_exchange']:,}",
                f"{f['bytes'] / (p['d'] - 1):,.0f}",
                msec(f["median_s"]),
                f"**{h.fmt(f['ratio'])}**",
                msec(g["median_s"]),
                f"**{h.fmt(g['ratio'])}**",
                mib(g.get("temp_bytes")),
                h.fmt(max(f["difference"], g["difference"]), ".1e"),
            )
        )
    lines += h.table(
        "steps | adjoint | `bytes_per_exchange` | bytes / product (forward) "
        "| forward (ms) | forward ratio | grad (ms) | grad ratio | grad temp MiB "
        "| largest difference",
        rows,
        "rlrrrrrrrr",
    )
    lines += [
        "",
        "Halos s hops deep carry about s times the rows of one hop on a grid, so "
        "the bytes per product stay put and the messages fall s-fold: on host "
        "devices, where a message has no latency, the time does not change beyond "
        "the run-to-run noise of this machine. *largest difference*: against "
        "`steps=1`, relative to the largest entry, over the Krylov matrix and the "
        "gradients.",
        "",
        f"jax {machine['versions']['jax']}, {machine['backend']}, "
        f"{machine['cores']} cores, XLA_FLAGS={machine['XLA_FLAGS']!r}, "
        f"{machine['time']}; the run took {wall_s / 60:.1f} min.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    parser.add_argument("--out", default="benchmarks/out/partition")
    parser.add_argument("--docs", action="store_true", help="also write the docs table")
    parser.add_argument(
        "--powers-only",
        action="store_true",
        help="only the matrix powers part (printed, not written to the docs)",
    )
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    log = h.Log()
    if args.powers_only:
        powers = run_powers(config["powers"], config["timing"], log)
        text = powers_markdown(
            powers, h.machine_info("equinox", "scipy"), log.elapsed()
        )
        h.write_results(Path(args.out), {"powers": powers}, text)
        if args.docs:
            Path("docs/benchmarks/partition_powers.md").write_text(text)
        print(text)
        return powers
    report = {"config": config}
    log(f"bytes per product {config['bytes']}")
    report["bytes"] = run_bytes(config["bytes"], log)
    log(f"time {config['time']}")
    report["time"] = run_time(config["time"], config["timing"], log)
    log(f"powers {config['powers']}")
    report["powers"] = run_powers(config["powers"], config["timing"], log)
    log(f"check float32 {config['check']}")
    checks = run_check(config["check"], np.float32, log)
    jax.config.update("jax_enable_x64", True)  # last: the float64 check
    checks += run_check(config["check"], np.float64, log)
    report["check"] = checks
    report["machine"] = h.machine_info("equinox", "scipy")
    report["wall_s"] = log.elapsed()
    text = markdown(report)
    powers = powers_markdown(report["powers"], report["machine"], report["wall_s"])
    h.write_results(Path(args.out), report, text + "\n" + powers)
    if args.docs:
        Path("docs/benchmarks/partition.md").write_text(text)
        Path("docs/benchmarks/partition_powers.md").write_text(powers)
    print(text + "\n" + powers)
    return report


if __name__ == "__main__":
    main()
