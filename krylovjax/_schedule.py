r"""Checkpoint schedules for a reverse pass that may keep only a few vectors: where
the forward pass stores its checkpoints, and in what order the reverse pass
recomputes vectors from them. Plain Python, run once at trace time.

The readouts' reverse pass (`_readout.py`) needs the vectors $x_{d-1}, \dots, x_0$
in that order, and keeps at most `checkpoints` of them at once besides its working
vectors. It runs in two levels:

- the forward pass stores a checkpoint every `every` vectors
  ($\lceil d/s\rceil - 1$ of them, `x0` being the first one);
- the reverse pass takes the segments between them from the last to the first,
  and within a segment of $l$ vectors, with $f$ vectors to spare, runs
  **binomial checkpointing** (Griewank's *revolve*, Griewank and Walther 2000,
  ACM TOMS 26(1)): with $f \geq l - 1$ it recomputes the whole segment once into
  a buffer; with fewer, it stores some of the segment's vectors on the way up,
  reverses the part above the last one stored, frees it, and so on, each step
  recomputed at most $r$ times, where $r$ is the smallest with
  $\binom{f + 1 + r}{r} \geq l$. That is the fewest recomputations any schedule
  with $f$ spare vectors can make (the paper's theorem).

`plan_checkpoints(d, checkpoints)` chooses the spacing and the spare vectors that
need the fewest recomputed products in all; `segment_actions(l, f)` is the schedule
of one segment, a list of `(action, argument)` pairs, and `reverse_actions` those
of all segments, last to first, which `_readout.py` runs in one loop.
"""

import functools
import math

# A segment's actions. `ADVANCE k`: the working state moves from vector k to k + 1.
# `STORE i`: slot i keeps the working state. `LOAD i`: the working state is slot
# i's (`START`: the segment's first vector, its checkpoint). `ADJOINT k`: the
# adjoint step of vector k, which the working state holds.
ADVANCE, STORE, LOAD, ADJOINT = 0, 1, 2, 3
START = -1


def _beta(snapshots: int, repetitions: int) -> int:
    """How many steps `snapshots` states (the segment's first one included) can
    reverse with each step recomputed at most `repetitions` times (0 for a
    negative count)."""
    if repetitions < 0:
        return 0
    return math.comb(snapshots + repetitions, snapshots)


def _repetitions(length: int, snapshots: int) -> int:
    r = 0
    while _beta(snapshots, r) < length:
        r += 1
    return r


def advances(length: int, spare: int) -> int:
    """How many products a segment of `length` vectors costs its reverse pass with
    `spare` vectors besides its first: $r l - \\binom{s + r}{r - 1}$ for
    $s$ = `spare` + 1 snapshots and the repetition number $r$ (Griewank and
    Walther's minimum; `segment_actions` attains it)."""
    if length <= 1:
        return 0
    s = min(spare, length - 1) + 1
    r = _repetitions(length, s)
    return r * length - _beta(s + 1, r - 1)


@functools.lru_cache(maxsize=256)
def segment_actions(length: int, spare: int) -> tuple[tuple[int, int], ...]:
    """The reverse pass of a segment of `length` vectors, from its first one
    (`LOAD START`), with slots `0 .. spare - 1` to keep vectors in: the adjoint
    steps of vectors `length - 1` down to `0` (relative to the segment), each when
    the working state holds its vector."""
    actions: list[tuple[int, int]] = []
    at = [START]  # the vector the working state holds (START: none yet)

    def go(lo: int, source: int, to: int) -> None:
        """Move the working state to vector `to`, from `lo` (kept in `source`)."""
        if at[0] == START or at[0] > to or at[0] < lo:
            actions.append((LOAD, source))
            at[0] = lo
        for k in range(at[0], to):
            actions.append((ADVANCE, k))
        at[0] = to

    def reverse(lo: int, hi: int, source: int, slots: list[int]) -> None:
        """Adjoint steps `hi - 1 .. lo`; vector `lo` is kept in `source`, and
        `slots` are free."""
        while hi - lo > 1:
            # The first vector above `lo` to keep: the part below it is reversed
            # later with every slot, each step recomputed at most r - 1 more
            # times, the part above with one slot fewer and r times (the split
            # that attains `advances`).
            s = len(slots) + 1
            r = _repetitions(hi - lo, s)
            below = max(1, _beta(s, r - 2), hi - lo - _beta(s - 1, r))
            mid = lo + below
            right = hi - mid
            go(lo, source, mid)
            if right > 1:
                actions.append((STORE, slots[-1]))
                reverse(mid, hi, slots[-1], slots[:-1])
            else:
                actions.append((ADJOINT, mid))
            hi = mid
        go(lo, source, lo)
        actions.append((ADJOINT, lo))

    reverse(0, length, START, list(range(min(spare, length - 1))))
    return tuple(actions)


# A plan that recomputes whole segments into a buffer runs as plain loops (and, for
# small vectors, pairs a chunk of steps in one product), while a binomial schedule
# takes a branch per action: so the buffered plan is chosen unless the binomial
# one saves more than this share of the products.
BUFFERED_SLACK = 0.1


@functools.lru_cache(maxsize=256)
def plan_checkpoints(d: int, checkpoints: int) -> tuple[int, int]:
    """`(every, spare)`: the checkpoint spacing and the spare vectors per segment
    that reverse `d` vectors with the fewest recomputed products while keeping at
    most `checkpoints` vectors (the checkpoints after `x0`, plus the spare ones).
    `(1, 0)` stores every vector."""
    if checkpoints >= d - 1:
        return 1, 0
    best = buffered = None
    for every in range(2, d + 1):
        count = -(-d // every)
        spare = min(checkpoints - (count - 1), every - 1)
        if spare < 0:
            continue
        last = d - (count - 1) * every
        cost = (count - 1) * advances(every, spare) + advances(last, spare)
        key = (cost, count - 1 + spare)
        if best is None or key < best[0]:
            best = (key, every, spare)
        if spare == every - 1 and (buffered is None or key < buffered[0]):
            buffered = (key, every, spare)
    assert best is not None  # every = d, spare = checkpoints >= 0 always fits
    if buffered is not None and buffered[0][0] <= (1 + BUFFERED_SLACK) * best[0][0]:
        best = buffered
    return best[1], best[2]


@functools.lru_cache(maxsize=64)
def reverse_actions(d: int, every: int, spare: int) -> tuple[tuple[int, int], ...]:
    """The schedules of all segments of `d` vectors split every `every`, from the
    last segment to the first, in absolute terms: `ADVANCE k` and `ADJOINT k` name
    vector `k`, `LOAD i` slot `i` for `i >= 0` and checkpoint `-i - 1` for
    `i < 0` (checkpoint 0 being `x0`, checkpoint `c` vector `c * every`)."""
    count = -(-d // every)
    rows = []
    for c in reversed(range(count)):
        lo = c * every
        length = min(every, d - lo)
        for kind, arg in segment_actions(length, spare):
            if kind == LOAD and arg == START:
                arg = -c - 1
            elif kind in (ADVANCE, ADJOINT):
                arg += lo
            rows.append((kind, arg))
    return tuple(rows)
