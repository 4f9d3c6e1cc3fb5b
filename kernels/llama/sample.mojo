# Sampling one token from one row of logits (materl/engines/sampling.py:sample_tokens is the
# reference; the engine contract is materl/engines/base.py):
#
#   s = logits / T, logprob = log_softmax(s)[token]   (no top-k/top-p renormalisation)
#   greedy: token = argmax(logits) (the first maximum)
#   else: the kept set is the top_k tokens of s (all if top_k = 0), then of those the smallest
#   prefix, by probability descending, whose mass reaches top_p (token i is kept iff the mass
#   of the tokens before it is < top_p, on the top-k-renormalised distribution); ties in s are
#   ordered by token id. token = the first kept j, in id order, whose cumulative weight exceeds
#   u * (total kept weight), u the request's uniform in [0, 1).
#
# Everything here reads one row and writes one row, in a fixed order.

from std.math import exp, log
from std.memory import stack_allocation

comptime L = 8
comptime V8 = SIMD[DType.float32, L]
comptime D8 = SIMD[DType.float64, L]
comptime FPtr = Pointer[Float32, MutUntrackedOrigin]
comptime I32Ptr = Pointer[Int32, MutUntrackedOrigin]

# top-k/top-p candidates: a histogram of s by distance below the best, BINS_PER_NAT bins a nat,
# finds the smallest threshold that surely keeps the kept set; only tokens above it are sorted
comptime BINS = 1024
comptime BINS_PER_NAT = Float32(16)


@always_inline
def comes_first(va: Float32, ia: Int32, vb: Float32, ib: Int32) -> Bool:
    """Order of the sorted candidates: larger value first, then smaller token id."""
    return va > vb or (va == vb and ia < ib)


def sift_down(v: FPtr, ids: I32Ptr, start: Int, end: Int):
    """Heap property for heap_sort: a parent never comes before its children."""
    var root = start
    while True:
        var child = 2 * root + 1
        if child >= end:
            return
        if child + 1 < end and comes_first(v[unsafe_offset=child], ids[unsafe_offset=child],
                                           v[unsafe_offset=child + 1], ids[unsafe_offset=child + 1]):
            child += 1
        if not comes_first(v[unsafe_offset=root], ids[unsafe_offset=root], v[unsafe_offset=child],
                           ids[unsafe_offset=child]):
            return
        swap(v, ids, root, child)
        root = child


@always_inline
def swap(v: FPtr, ids: I32Ptr, a: Int, b: Int):
    var tv = v[unsafe_offset=a]
    var ti = ids[unsafe_offset=a]
    v[unsafe_offset=a] = v[unsafe_offset=b]
    ids[unsafe_offset=a] = ids[unsafe_offset=b]
    v[unsafe_offset=b] = tv
    ids[unsafe_offset=b] = ti


def heap_sort(v: FPtr, ids: I32Ptr, n: Int):
    """Sort n (value, id) pairs into comes_first order (deterministic: a total order)."""
    var start = n // 2 - 1
    while start >= 0:
        sift_down(v, ids, start, n)
        start -= 1
    var end = n - 1
    while end > 0:
        swap(v, ids, 0, end)
        sift_down(v, ids, 0, end)
        end -= 1


@always_inline
def weights8(logits: FPtr, j: Int, T: Float32, m: Float32) -> V8:
    """exp(s - m) of 8 tokens from j, s = logits / T."""
    return exp(logits.unsafe_load[width=L](j) / V8(T) - V8(m))


def row_max(logits: FPtr, V: Int, T: Float32) -> Float32:
    """max_j logits_j / T (V is a multiple of 8)."""
    var acc = logits.unsafe_load[width=L](0) / V8(T)
    for j in range(L, V, L):
        acc = max(acc, logits.unsafe_load[width=L](j) / V8(T))
    return acc.reduce_max()


def log_partition(logits: FPtr, V: Int, T: Float32, m: Float32) -> Float32:
    """log sum_j exp(s_j - m): float32 lanes, then a fixed tree."""
    var acc = V8(0)
    for j in range(0, V, L):
        acc += weights8(logits, j, T, m)
    return log(acc.reduce_add())


def argmax(logits: FPtr, V: Int) -> Int:
    """The first index of the largest logit."""
    var acc = logits.unsafe_load[width=L](0)
    for j in range(L, V, L):
        acc = max(acc, logits.unsafe_load[width=L](j))
    var best = acc.reduce_max()
    for j in range(V):
        if logits[unsafe_offset=j] == best:
            return j
    return 0


def draw_unfiltered(logits: FPtr, V: Int, T: Float32, m: Float32, u: Float64) -> Int:
    """Inverse CDF over all tokens in id order, blocks of 8 summed in float64."""
    var total = Float64(0)
    for j in range(0, V, L):
        total += weights8(logits, j, T, m).cast[DType.float64]().reduce_add()
    var target = u * total
    var acc = Float64(0)
    var last = 0
    for j in range(0, V, L):
        var w = weights8(logits, j, T, m).cast[DType.float64]()
        var block = w.reduce_add()
        if acc + block > target:
            for l in range(L):
                acc += w[l]
                if acc > target:
                    return j + l
        acc += block
        for l in range(L):
            if w[l] > 0:
                last = j + l
    return last  # u * total rounded past the last cumulative weight


@always_inline
def bin_of(s: Float32, m: Float32) -> Int:
    """Histogram bin of a token BINS_PER_NAT bins a nat below the best; the last bin takes the rest."""
    return Int(min((m - s) * BINS_PER_NAT, Float32(BINS - 1)))


def candidates(logits: FPtr, V: Int, T: Float32, m: Float32, top_k: Int, top_p: Float64, cv: FPtr,
               ci: I32Ptr) -> Tuple[Int, Float64]:
    """Gather into (cv, ci) every token at least as likely as the kept set's least likely one
    (and a histogram bin more); returns (how many, the total weight of all tokens)."""
    var count = stack_allocation[BINS, Int]()
    var mass = stack_allocation[BINS, Float64]()
    for b in range(BINS):
        count[unsafe_offset=b] = 0
        mass[unsafe_offset=b] = 0
    var z = Float64(0)
    for j in range(V):
        var s = logits[unsafe_offset=j] / T
        var w = Float64(exp(s - m))
        z += w
        var b = bin_of(s, m)
        count[unsafe_offset=b] += 1
        mass[unsafe_offset=b] += w
    var last = BINS - 1
    var n = 0
    var cum = Float64(0)
    for b in range(BINS):
        n += count[unsafe_offset=b]
        cum += mass[unsafe_offset=b]
        if (top_k > 0 and n >= top_k) or (top_k <= 0 and cum >= top_p * z):
            last = min(b + 1, BINS - 1)  # one bin more: the sums below are in another order
            break
    n = 0
    for j in range(V):
        var s = logits[unsafe_offset=j] / T
        if bin_of(s, m) <= last:
            cv[unsafe_offset=n] = s
            ci[unsafe_offset=n] = Int32(j)
            n += 1
    return (n, z)


def kept_prefix(cv: FPtr, n: Int, m: Float32, top_k: Int, top_p: Float64, z: Float64) -> Int:
    """How many of the n sorted candidates survive top-k, then top-p on the renormalised rest."""
    var k = min(top_k, n) if top_k > 0 else n
    if top_p >= 1.0:
        return k
    var zk = z
    if top_k > 0:
        zk = 0
        for i in range(k):
            zk += Float64(exp(cv[unsafe_offset=i] - m))
    var before = Float64(0)
    for i in range(k):
        if before >= top_p * zk:
            return i
        before += Float64(exp(cv[unsafe_offset=i] - m))
    return k


def draw_filtered(logits: FPtr, V: Int, T: Float32, m: Float32, top_k: Int, top_p: Float64, u: Float64,
                  cv: FPtr, ci: I32Ptr) -> Int:
    var got = candidates(logits, V, T, m, top_k, top_p, cv, ci)
    heap_sort(cv, ci, got[0])
    var kept = kept_prefix(cv, got[0], m, top_k, top_p, got[1])
    # id order for the inverse CDF: sort the kept ids ascending (cv reused as -id keys)
    for i in range(kept):
        cv[unsafe_offset=i] = -Float32(ci[unsafe_offset=i])
    heap_sort(cv, ci, kept)
    var total = Float64(0)
    for i in range(kept):
        total += Float64(exp(logits[unsafe_offset=Int(ci[unsafe_offset=i])] / T - m))
    var target = u * total
    var acc = Float64(0)
    for i in range(kept):
        acc += Float64(exp(logits[unsafe_offset=Int(ci[unsafe_offset=i])] / T - m))
        if acc > target:
            return Int(ci[unsafe_offset=i])
    return Int(ci[unsafe_offset=kept - 1])


def sample_row(logits: FPtr, V: Int, T: Float32, top_k: Int, top_p: Float64, greedy: Bool, u: Float64, cv: FPtr,
               ci: I32Ptr) -> Tuple[Int, Float32]:
    """(token, log_softmax(logits / T)[token]); cv/ci: V floats and V int32 of scratch; V must be
    a multiple of 8."""
    var m = row_max(logits, V, T)
    var lz = log_partition(logits, V, T, m)
    var token: Int
    if greedy:
        token = argmax(logits, V)
    elif (top_k > 0 and top_k < V) or top_p < 1.0:
        token = draw_filtered(logits, V, T, m, top_k, top_p, u, cv, ci)
    else:
        token = draw_unfiltered(logits, V, T, m, u)
    return (token, logits[unsafe_offset=token] / T - m - lz)
