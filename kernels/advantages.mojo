# Group-relative advantages on (B,) sequence scores with a dense group index 0..G-1:
#   grpo: (S - mean_g) / (std_g + eps)   (singleton group: mean 0, std 1; scale group|batch|none)
#   rloo: S - (sum_g S - S) / (n - 1)    (singleton: baseline 0)
# written as (B,) or broadcast over a (B, T) mask (trained tokens get the row's advantage).
# Reference: materl/ops/advantages.py ("grpo", "rloo") with (B,) rewards; the group statistics
# follow materl/ops/_masked.py group_stats (two passes, unbiased std; a group of equal scores has
# mean = that score and std 0, so it gets advantage exactly 0). Arithmetic in float64.
#
# Calling convention (materl/kernels/loader.py): @export ... abi("C") -> Int; 0 = success,
# -1 = a group index outside [0, G).

from std.math import sqrt

comptime GRPO = 0
comptime RLOO = 1

comptime SCALE_GROUP = 0
comptime SCALE_BATCH = 1
comptime SCALE_NONE = 2

comptime F64Ptr = Pointer[Float64, MutUntrackedOrigin]
comptime I64Ptr = Pointer[Int64, MutUntrackedOrigin]


def group_sums[dt: DType](scores: Pointer[Scalar[dt], MutUntrackedOrigin], index: I64Ptr, B: Int, G: Int,
                          count: F64Ptr, mean: F64Ptr, std: F64Ptr, lo: F64Ptr, hi: F64Ptr) -> Bool:
    """Fill count, mean and unbiased std (0 for a singleton) per group; False on a bad index.
    A group of equal scores gets that score as its mean and std exactly 0 (no rounding residue
    for a later division by std + eps to blow up)."""
    for g in range(G):
        count[unsafe_offset=g] = 0.0
        mean[unsafe_offset=g] = 0.0
        std[unsafe_offset=g] = 0.0
    for b in range(B):
        var g = Int(index[unsafe_offset=b])
        if g < 0 or g >= G:
            return False
        var s = scores[unsafe_offset=b].cast[DType.float64]()
        if count[unsafe_offset=g] == 0.0:
            lo[unsafe_offset=g] = s
            hi[unsafe_offset=g] = s
        lo[unsafe_offset=g] = min(lo[unsafe_offset=g], s)
        hi[unsafe_offset=g] = max(hi[unsafe_offset=g], s)
        count[unsafe_offset=g] += 1.0
        mean[unsafe_offset=g] += s
    for g in range(G):
        var flat = lo[unsafe_offset=g] == hi[unsafe_offset=g]
        mean[unsafe_offset=g] = hi[unsafe_offset=g] if flat else mean[unsafe_offset=g] / count[unsafe_offset=g]
    for b in range(B):
        var g = Int(index[unsafe_offset=b])
        var dev = scores[unsafe_offset=b].cast[DType.float64]() - mean[unsafe_offset=g]
        std[unsafe_offset=g] += dev * dev
    for g in range(G):
        var n = count[unsafe_offset=g]
        var flat = lo[unsafe_offset=g] == hi[unsafe_offset=g]
        std[unsafe_offset=g] = sqrt(std[unsafe_offset=g] / (n - 1.0)) if n > 1.0 and not flat else 0.0
    return True


def batch_std[dt: DType](scores: Pointer[Scalar[dt], MutUntrackedOrigin], B: Int) -> Float64:
    if B < 2:
        return 0.0
    var total: Float64 = 0.0
    for b in range(B):
        total += scores[unsafe_offset=b].cast[DType.float64]()
    var mean = total / Float64(B)
    var sq: Float64 = 0.0
    for b in range(B):
        var dev = scores[unsafe_offset=b].cast[DType.float64]() - mean
        sq += dev * dev
    return sqrt(sq / Float64(B - 1))


def advantages[dt: DType](scores_addr: Int, index_addr: Int, B: Int, G: Int, mask_addr: Int, T: Int,
                          estimator: Int, scale: Int, eps: Float64, scratch_addr: Int, out_addr: Int) -> Int:
    var scores = Pointer[Scalar[dt], MutUntrackedOrigin](unsafe_from_address=scores_addr)
    var mask = Pointer[Scalar[dt], MutUntrackedOrigin](unsafe_from_address=mask_addr)
    var out = Pointer[Scalar[dt], MutUntrackedOrigin](unsafe_from_address=out_addr)
    var index = I64Ptr(unsafe_from_address=index_addr)
    var count = F64Ptr(unsafe_from_address=scratch_addr)
    var mean = count.unsafe_offset(G)
    var std = count.unsafe_offset(2 * G)
    var lo = count.unsafe_offset(3 * G)
    var hi = count.unsafe_offset(4 * G)
    if not group_sums[dt](scores, index, B, G, count, mean, std, lo, hi):
        return -1
    var bstd = batch_std[dt](scores, B) if scale == SCALE_BATCH else 0.0
    for b in range(B):
        var g = Int(index[unsafe_offset=b])
        var s = scores[unsafe_offset=b].cast[DType.float64]()
        var n = count[unsafe_offset=g]
        var a: Float64
        if estimator == RLOO:
            # (n mean - S) / (n - 1), written so that a group of equal scores gives exactly S
            var base = mean[unsafe_offset=g] + (mean[unsafe_offset=g] - s) / (n - 1.0) if n > 1.0 else 0.0
            a = s - base
        else:
            var m = mean[unsafe_offset=g] if n > 1.0 else 0.0
            var d: Float64 = 1.0
            if scale == SCALE_GROUP:
                d = (std[unsafe_offset=g] if n > 1.0 else 1.0) + eps
            elif scale == SCALE_BATCH:
                d = bstd + eps
            a = (s - m) / d
        if mask_addr == 0:
            out[unsafe_offset=b] = a.cast[dt]()
            continue
        for t in range(T):
            var i = b * T + t
            out[unsafe_offset=i] = a.cast[dt]() if mask[unsafe_offset=i] != 0 else Scalar[dt](0)
    return 0


@export
def group_advantages_f64(scores: Int, index: Int, B: Int, G: Int, mask: Int, T: Int, estimator: Int, scale: Int,
                         eps: Float64, scratch: Int, out_addr: Int) abi("C") -> Int:
    """Advantages of float64 scores: (B,) when mask = 0, else (B, T). scratch: 5G float64."""
    return advantages[DType.float64](scores, index, B, G, mask, T, estimator, scale, eps, scratch, out_addr)


@export
def group_advantages_f32(scores: Int, index: Int, B: Int, G: Int, mask: Int, T: Int, estimator: Int, scale: Int,
                         eps: Float64, scratch: Int, out_addr: Int) abi("C") -> Int:
    """Advantages of float32 scores (float64 arithmetic): (B,) when mask = 0, else (B, T)."""
    return advantages[DType.float32](scores, index, B, G, mask, T, estimator, scale, eps, scratch, out_addr)
