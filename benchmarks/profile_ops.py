"""Where the time of one `krylov` forward + gradient pass goes, op by op.

Profiles `jax.jit(jax.value_and_grad(loss))` with `loss(A, x0) = sum(krylov(A, x0,
d, method=m) * W)` (float32, `x0` of shape `(n,)`) with `jax.profiler` and prints the
time of each compiled XLA op, summed over the op kinds and for the slowest ops, with
the op's HLO line (its shape tells which product or copy it is). Side by side in the
same run it also times the whole pass for the scan and for the chosen method, and a
reference: the three full products `A @ X`, `A^T @ G` and `G @ X^T` of shapes
`(n, n) x (n, d)` that any method doing the forward pass, the gradient of `x0` and
the gradient of `A` as matrix products needs at least, in one jitted call.

Run `python benchmarks/profile_ops.py --n 64 --d 4096 --method doubling`. The
profiler's op times overlap when XLA runs independent ops on different threads, so
their sum can exceed the wall time; read them as shares.
"""

import argparse
import collections
import gzip
import json
import pathlib
import re
import tempfile

import _harness as h
import jax
import jax.numpy as jnp
import numpy as np
from bench_methods import make_step, random_matrix


@jax.jit
def three_products(A, X, G):
    return A @ X, A.T @ G, G @ X.T


def op_times(fn, args, calls):
    """Microseconds per call of each XLA op of `fn`, from a `jax.profiler` trace."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        (path,) = pathlib.Path(trace_dir).glob("**/*.trace.json.gz")
        events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    times = collections.defaultdict(float)
    for event in events:
        # XLA ops are named like `dot_general.114` or `fusion.3`; Python frames and
        # runtime events carry other names.
        if event.get("ph") == "X" and re.fullmatch(r"[a-z_\-]+(\.\d+)?", event["name"]):
            times[event["name"]] += event["dur"] / calls
    return dict(times)


def hlo_line(hlo, op):
    match = re.search(rf"\n\s*(?:ROOT )?%?{re.escape(op)} = ([^\n]*)", hlo)
    if match is None:
        return ""
    # The result shape and the op with its operands; metadata left out.
    return match.group(1).split(", metadata=")[0].split(", backend_config=")[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--method", default="doubling", choices=("scan", "doubling"))
    parser.add_argument("--calls", type=int, default=20, help="profiled calls")
    parser.add_argument("--repeats", type=int, default=50, help="timed calls")
    parser.add_argument("--top", type=int, default=15, help="slowest ops listed")
    args = parser.parse_args()
    n, d = args.n, args.d

    rng = np.random.default_rng(0)
    A = jnp.asarray(random_matrix(rng, n, 0.9), jnp.float32)
    x0 = jnp.asarray(rng.standard_normal(n), jnp.float32)
    W, X = (jnp.asarray(rng.standard_normal((n, d)), jnp.float32) for _ in range(2))

    step = make_step(args.method, d)
    hlo = step.lower(A, x0, W).compile().as_text()
    times = op_times(step, (A, x0, W), args.calls)
    by_kind = collections.defaultdict(float)
    for op, t in times.items():
        by_kind[re.sub(r"\.\d+$", "", op)] += t
    total = sum(times.values())
    print(f"method={args.method} n={n} d={d} float32, {len(times)} ops profiled")
    print(f"sum of op times: {total:.0f} us per call")
    for kind, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:32s} {t:8.1f} us  {t / total:6.1%}")
    print(f"slowest {args.top} ops:")
    for op, t in sorted(times.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {t:8.1f} us  {op:24s} {hlo_line(hlo, op)[:110]}")

    fns = {"scan": make_step("scan", d), args.method: step}
    fn_args = {"scan": (A, x0, W), args.method: (A, x0, W)}
    fns["3 products"], fn_args["3 products"] = three_products, (A, X, W)
    calls = [h.ready(fn, fn_args[name]) for name, fn in fns.items()]
    rounds = {"min_rounds": args.repeats, "max_rounds": args.repeats, "max_batch": 1}
    timed = h.time_interleaved(calls, **rounds)
    walls = {name: t["median_s"] for name, t in zip(fns, timed, strict=True)}
    print(f"wall time per call (median of {args.repeats}, interleaved):")
    for name, t in walls.items():
        print(f"  {name:12s} {t * 1e3:8.3f} ms   scan / this {walls['scan'] / t:5.2f}")


if __name__ == "__main__":
    main()
