# y = x @ W.T (+ bias) for float32, W in torch's Linear layout (N, K) row-major, read in place.
#
# Every output element y[m, n] is computed the same way whatever the tile, the number of rows
# M, the column range or the thread that computes it: eight float32 lanes accumulate
# x[m, k:k+8] * W[n, k:k+8] with one fused multiply-add per lane, k = 0, 8, 16, ... in order,
# then the lanes are summed by SIMD.reduce_add (a fixed tree), then the bias is added, then (for
# ACCUMULATE) the result is added to y. So a row's result does not depend on which other rows
# share the call: that is what makes the engine's output independent of its batch.
# Tiles only decide which loads are shared (a weight row loaded once serves every row of a tile).
#
# Decoding (up to STREAM_ROWS rows) streams every weight once per call, so its speed is how fast
# one thread pulls weights from memory. Its tile is all rows x two weight rows: each x load feeds
# two FMAs (9 loads per 8 FMAs with one weight row), and 16 accumulators fit the 32 vector
# registers of AVX-512 machines (three weight rows spill: slower; elsewhere one weight row). The
# weights are prefetched into L2 (prefetcht1) 32 KB ahead. On SmolLM2-135M, 8 rows, the Zen 4
# machine of benchmarks/RESULTS.md ("decode", 2026-11-26): 32 -> 22.5 ms a step on two threads,
# 58 -> 35 ms on one (before: one weight row, prefetched into L1 4 KB ahead); one row: 18 ms on
# two threads, what torch's sum of the same 538 MB takes.

from std.sys import prefetch, PrefetchOptions, CompilationTarget
from std.utils import StaticTuple

comptime L = 8  # float32 lanes (one AVX2 register)
comptime V8 = SIMD[DType.float32, L]
comptime FPtr = Pointer[Float32, MutUntrackedOrigin]

comptime STORE = 0  # y = x @ W.T + b
comptime ACCUMULATE = 1  # y = y + (x @ W.T + b)   (a residual add, in HF's order)

comptime ROW_CHUNK = 64  # rows of x kept hot in L2 while all weight rows stream past
comptime STREAM_ROWS = 8  # up to this many rows: two weight rows at a time, every row of x
# weight rows per decode tile: 2 where 16 accumulators fit the registers (AVX-512's 32), else 1
comptime DECODE_NR = 2 if CompilationTarget.has_avx512f() else 1
comptime PREFETCH = 8192  # floats ahead of each streamed weight row (32 KB; 4 KB: 26 ms, 16-64 KB: the same 22-23 ms)


@always_inline
def tile[MR: Int, NR: Int, STREAM: Bool](x: FPtr, ldx: Int, w: FPtr, K: Int, y: FPtr, ldy: Int, bias: FPtr,
                                          has_bias: Bool, mode: Int):
    """y[i, j] for i < MR rows of x (stride ldx) and j < NR consecutive weight rows (stride K)."""
    var acc = StaticTuple[V8, MR * NR](fill=V8(0))
    var k = 0
    while k < K:
        comptime if STREAM:
            comptime for j in range(NR):
                prefetch[PrefetchOptions().for_read().medium_locality().to_data_cache()](
                    w.unsafe_offset(j * K + k + PREFETCH))
        comptime for i in range(MR):
            var xv = x.unsafe_load[width=L](i * ldx + k)
            comptime for j in range(NR):
                acc[i * NR + j] = xv.fma(w.unsafe_load[width=L](j * K + k), acc[i * NR + j])
        k += L
    comptime for i in range(MR):
        comptime for j in range(NR):
            var v = acc[i * NR + j].reduce_add()
            if has_bias:
                v = v + bias[unsafe_offset=j]
            if mode == ACCUMULATE:
                v = y[unsafe_offset=i * ldy + j] + v
            y[unsafe_offset=i * ldy + j] = v


@always_inline
def rows_tile[NR: Int, STREAM: Bool](rows: Int, x: FPtr, ldx: Int, w: FPtr, K: Int, y: FPtr, ldy: Int, bias: FPtr,
                                      has_bias: Bool, mode: Int):
    """``tile`` with its row count (1..8) chosen at run time."""
    if rows == 8:
        tile[8, NR, STREAM](x, ldx, w, K, y, ldy, bias, has_bias, mode)
    elif rows == 7:
        tile[7, NR, STREAM](x, ldx, w, K, y, ldy, bias, has_bias, mode)
    elif rows == 6:
        tile[6, NR, STREAM](x, ldx, w, K, y, ldy, bias, has_bias, mode)
    elif rows == 5:
        tile[5, NR, STREAM](x, ldx, w, K, y, ldy, bias, has_bias, mode)
    elif rows == 4:
        tile[4, NR, STREAM](x, ldx, w, K, y, ldy, bias, has_bias, mode)
    elif rows == 3:
        tile[3, NR, STREAM](x, ldx, w, K, y, ldy, bias, has_bias, mode)
    elif rows == 2:
        tile[2, NR, STREAM](x, ldx, w, K, y, ldy, bias, has_bias, mode)
    else:
        tile[1, NR, STREAM](x, ldx, w, K, y, ldy, bias, has_bias, mode)


def gemm(x: FPtr, ldx: Int, M: Int, w: FPtr, K: Int, n0: Int, n1: Int, y: FPtr, ldy: Int, bias: FPtr,
         has_bias: Bool, mode: Int):
    """Columns n0 <= n < n1 of x @ W.T (+ bias) for all M rows; column n goes to y[m * ldy + n - n0].

    K must be a multiple of 8 (the engine checks the model's shapes). ``bias`` points at
    bias[0] when ``has_bias``.
    """
    var m0 = 0
    while m0 < M:
        var mc = ROW_CHUNK if m0 + ROW_CHUNK <= M else M - m0
        var xm = x.unsafe_offset(m0 * ldx)
        var ym = y.unsafe_offset(m0 * ldy)
        if mc <= STREAM_ROWS:  # decoding: bandwidth-bound, each weight row once for all rows
            var n = n0
            while n + DECODE_NR <= n1:
                rows_tile[DECODE_NR, True](mc, xm, ldx, w.unsafe_offset(n * K), K, ym.unsafe_offset(n - n0), ldy,
                                           bias.unsafe_offset(n), has_bias, mode)
                n += DECODE_NR
            if n < n1:
                rows_tile[1, True](mc, xm, ldx, w.unsafe_offset(n * K), K, ym.unsafe_offset(n - n0), ldy,
                                   bias.unsafe_offset(n), has_bias, mode)
        else:  # prefill: compute-bound, 4 x 3 register tiles
            var n = n0
            while n < n1:
                var nr = 3 if n + 3 <= n1 else 1
                var m = 0
                while m < mc:
                    var mr = 4 if m + 4 <= mc else mc - m
                    var xt = xm.unsafe_offset(m * ldx)
                    var wt = w.unsafe_offset(n * K)
                    var yt = ym.unsafe_offset(m * ldy + n - n0)
                    if nr == 3:
                        rows_tile[3, False](mr, xt, ldx, wt, K, yt, ldy, bias.unsafe_offset(n), has_bias, mode)
                    else:
                        rows_tile[1, False](mr, xt, ldx, wt, K, yt, ldy, bias.unsafe_offset(n), has_bias, mode)
                    m += mr
                n += nr
        m0 += mc
