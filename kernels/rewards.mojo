# Reward kernels on padded token-id buffers: ids (B, T) int64 row-major, lengths (B,) int64.
#
# Each reward is a streaming accumulator: `step(row, t)` sees token t of a row once, `value()`
# (or a function of the length) gives the row's score. The exported kernels below run one
# accumulator per row; materl/kernels/fusion.py appends a generated kernel to this file that runs
# several accumulators in ONE pass over each row. Python references: materl/ops/reward_builtins.py
# (repetition, diversity, length) -- the results are bit-identical (ratios of integer counts).
#
# Calling convention (see materl/kernels/loader.py): @export ... abi("C") -> Int, addresses and
# sizes as Int, reals as Float64; 0 = success, -1 = a length outside [0, T], -2 = scratch too small.

from std.math import sqrt

comptime I64Ptr = Pointer[Int64, MutUntrackedOrigin]
comptime F64Ptr = Pointer[Float64, MutUntrackedOrigin]


def next_pow2(x: Int) -> Int:
    var c = 2
    while c < x:
        c *= 2
    return c


struct NGramCounter:
    """Counts the W = L - n + 1 windows ids[j:j+n] of a row and how many repeat an earlier one.

    An open-addressing hash set of window start positions (compared token by token, so hash
    collisions never miscount) lives in caller scratch: `keys` then `hashes`, `cap` each.
    """

    var keys: I64Ptr
    var hashes: I64Ptr
    var cap: Int
    var n: Int
    var windows: Int
    var repeats: Int

    def __init__(out self, scratch: I64Ptr, cap_max: Int, n: Int, length: Int):
        var w = length - n + 1
        self.cap = next_pow2(2 * w) if w > 0 else 2
        if self.cap > cap_max:
            self.cap = cap_max
        self.keys = scratch
        self.hashes = scratch.unsafe_offset(cap_max)
        self.n = n
        self.windows = 0
        self.repeats = 0
        for i in range(self.cap):
            self.keys[unsafe_offset=i] = -1

    def step(mut self, row: I64Ptr, t: Int):
        if t + 1 < self.n:
            return
        var s = t + 1 - self.n
        var h: UInt64 = 14695981039346656037
        for k in range(self.n):
            h = (h ^ UInt64(row[unsafe_offset=s + k])) * 1099511628211
        h ^= h >> 29
        var mask = self.cap - 1
        var slot = Int(h & UInt64(mask))
        self.windows += 1
        while True:
            var p = Int(self.keys[unsafe_offset=slot])
            if p < 0:
                self.keys[unsafe_offset=slot] = Int64(s)
                self.hashes[unsafe_offset=slot] = Int64(h)
                return
            if self.hashes[unsafe_offset=slot] == Int64(h):
                var same = True
                for k in range(self.n):
                    if row[unsafe_offset=p + k] != row[unsafe_offset=s + k]:
                        same = False
                        break
                if same:
                    self.repeats += 1
                    return
            slot = (slot + 1) & mask

    def repetition(self) -> Float64:
        """-(W - U) / W, 0 when W = 0 (materl.ops.reward_builtins.repetition)."""
        if self.windows == 0:
            return 0.0
        return 0.0 - Float64(self.repeats) / Float64(self.windows)

    def diversity(self) -> Float64:
        """U / W, 0 when W = 0 (materl.ops.reward_builtins.diversity)."""
        if self.windows == 0:
            return 0.0
        return Float64(self.windows - self.repeats) / Float64(self.windows)


struct PatternMatcher:
    """1.0 once the m tokens at `pattern` occur contiguously in the row, else 0.0."""

    var pattern: I64Ptr
    var m: Int
    var found: Bool

    def __init__(out self, pattern: I64Ptr, m: Int):
        self.pattern = pattern
        self.m = m
        self.found = False

    def step(mut self, row: I64Ptr, t: Int):
        if self.found or t + 1 < self.m:
            return
        var s = t + 1 - self.m
        for k in range(self.m):
            if row[unsafe_offset=s + k] != self.pattern[unsafe_offset=k]:
                return
        self.found = True

    def value(self) -> Float64:
        return 1.0 if self.found else 0.0


def length_score(length: Int, lo: Int, hi: Int, scale: Float64) -> Float64:
    """Score max(0, 1 - d / scale), d = max(lo - L, 0, L - hi) (materl.ops.reward_builtins.length)."""
    var d = lo - length
    if d < 0:
        d = 0
    if length - hi > d:
        d = length - hi
    var r = 1.0 - Float64(d) / scale
    return r if r > 0.0 else 0.0


def check_lengths(lens: I64Ptr, B: Int, T: Int) -> Bool:
    for b in range(B):
        var L = Int(lens[unsafe_offset=b])
        if L < 0 or L > T:
            return False
    return True


def ngram_rows(ids_addr: Int, lens_addr: Int, B: Int, T: Int, n: Int, scratch_addr: Int, cap_max: Int,
               out_addr: Int, want_repetition: Bool) -> Int:
    var ids = I64Ptr(unsafe_from_address=ids_addr)
    var lens = I64Ptr(unsafe_from_address=lens_addr)
    var out = F64Ptr(unsafe_from_address=out_addr)
    var scratch = I64Ptr(unsafe_from_address=scratch_addr)
    if not check_lengths(lens, B, T):
        return -1
    if cap_max < next_pow2(2 * T):
        return -2
    for b in range(B):
        var L = Int(lens[unsafe_offset=b])
        var row = ids.unsafe_offset(b * T)
        var acc = NGramCounter(scratch, cap_max, n, L)
        for t in range(L):
            acc.step(row, t)
        out[unsafe_offset=b] = acc.repetition() if want_repetition else acc.diversity()
    return 0


@export
def repetition(ids_addr: Int, lens_addr: Int, B: Int, T: Int, n: Int, scratch_addr: Int, cap_max: Int,
               out_addr: Int) abi("C") -> Int:
    """Set out[b] = -(repeated n-gram windows) / windows of row b. scratch: 2 * cap_max int64."""
    return ngram_rows(ids_addr, lens_addr, B, T, n, scratch_addr, cap_max, out_addr, True)


@export
def diversity(ids_addr: Int, lens_addr: Int, B: Int, T: Int, n: Int, scratch_addr: Int, cap_max: Int,
              out_addr: Int) abi("C") -> Int:
    """Set out[b] = distinct n-gram windows / windows of row b. scratch: 2 * cap_max int64."""
    return ngram_rows(ids_addr, lens_addr, B, T, n, scratch_addr, cap_max, out_addr, False)


@export
def pattern_match(ids_addr: Int, lens_addr: Int, B: Int, T: Int, pattern_addr: Int, m: Int,
                  out_addr: Int) abi("C") -> Int:
    """Set out[b] = 1.0 if the m-token pattern occurs within the first lengths[b] tokens, else 0.0."""
    var ids = I64Ptr(unsafe_from_address=ids_addr)
    var lens = I64Ptr(unsafe_from_address=lens_addr)
    var out = F64Ptr(unsafe_from_address=out_addr)
    var pattern = I64Ptr(unsafe_from_address=pattern_addr)
    if not check_lengths(lens, B, T):
        return -1
    for b in range(B):
        var L = Int(lens[unsafe_offset=b])
        var row = ids.unsafe_offset(b * T)
        var acc = PatternMatcher(pattern, m)
        for t in range(L):
            acc.step(row, t)
            if acc.found:
                break
        out[unsafe_offset=b] = acc.value()
    return 0


@export
def length_reward(lens_addr: Int, B: Int, lo: Int, hi: Int, scale: Float64, out_addr: Int) abi("C") -> Int:
    """Set out[b] = max(0, 1 - max(lo - L, 0, L - hi) / scale) with L = lengths[b]."""
    var lens = I64Ptr(unsafe_from_address=lens_addr)
    var out = F64Ptr(unsafe_from_address=out_addr)
    for b in range(B):
        out[unsafe_offset=b] = length_score(Int(lens[unsafe_offset=b]), lo, hi, scale)
    return 0


@export
def length_stats(lens_addr: Int, B: Int, T: Int, out_addr: Int) abi("C") -> Int:
    """Set out = [mean, unbiased std, min, max, fraction with L >= T] of the B lengths (zeros if B = 0)."""
    var lens = I64Ptr(unsafe_from_address=lens_addr)
    var out = F64Ptr(unsafe_from_address=out_addr)
    for k in range(5):
        out[unsafe_offset=k] = 0.0
    if B == 0:
        return 0
    var total: Float64 = 0.0
    var lo = Int(lens[unsafe_offset=0])
    var hi = lo
    var clipped = 0
    for b in range(B):
        var L = Int(lens[unsafe_offset=b])
        total += Float64(L)
        if L < lo:
            lo = L
        if L > hi:
            hi = L
        if L >= T:
            clipped += 1
    var mean = total / Float64(B)
    var sq: Float64 = 0.0
    for b in range(B):
        var dev = Float64(Int(lens[unsafe_offset=b])) - mean
        sq += dev * dev
    out[unsafe_offset=0] = mean
    out[unsafe_offset=1] = sqrt(sq / Float64(B - 1)) if B > 1 else 0.0
    out[unsafe_offset=2] = Float64(lo)
    out[unsafe_offset=3] = Float64(hi)
    out[unsafe_offset=4] = Float64(clipped) / Float64(B)
    return 0
