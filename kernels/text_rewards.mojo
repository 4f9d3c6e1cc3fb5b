# Lexicon rewards on completion text: VADER sentiment and profanity-list toxicity.
#
# Input: the completions' UTF-8 bytes concatenated (uint8) with B + 1 int64 offsets; a lexicon as
# an open-addressing hash table (materl/kernels/text_rewards.py builds it from the packaged word
# lists): `slots` (cap int64, entry index or -1, FNV-1a of the lowercased word), the entries'
# lowercased bytes (`keys`, E + 1 offsets `key_offs`), `flags`, `codes`, `valence`, `booster`.
# Python reference: materl/ops/text_rewards.py, whose docstring defines tokens and rules; the
# results are bit-identical (the same float64 operations in the same order, built without FMA).
#
# Calling convention (materl/kernels/loader.py): addresses and sizes as Int, reals as Float64;
# 0 = success, -3 = token scratch too small.

from std.math import sqrt

comptime I64Ptr = Pointer[Int64, MutUntrackedOrigin]
comptime F64Ptr = Pointer[Float64, MutUntrackedOrigin]
comptime U8Ptr = Pointer[UInt8, MutUntrackedOrigin]

# entry flags and special-word codes (materl/ops/text_rewards.py: IN_LEXICON..., SPECIAL)
comptime IN_LEXICON = 1
comptime BOOSTER = 2
comptime NEGATION = 4
comptime TOXIC = 8
comptime NO = 1
comptime NEVER = 2
comptime SO = 3
comptime THIS = 4
comptime WITHOUT = 5
comptime DOUBT = 6
comptime LEAST = 7
comptime AT = 8
comptime VERY = 9
comptime OR = 10
comptime NOR = 11
comptime BUT = 12
comptime KIND = 13
comptime OF = 14
# token bits
comptime UPPER = 1
comptime NEGATED = 2


@always_inline
def is_space(c: UInt8) -> Bool:
    """ASCII whitespace, as bytes.split() splits on."""
    return c == 32 or (c >= 9 and c <= 13)


@always_inline
def is_punct(c: UInt8) -> Bool:
    """Python's string.punctuation."""
    return (c >= 33 and c <= 47) or (c >= 58 and c <= 64) or (c >= 91 and c <= 96) or (c >= 123 and c <= 126)


@always_inline
def lower(c: UInt8) -> UInt8:
    if c >= 65 and c <= 90:
        return c + 32
    return c


struct Lexicon:
    """The word table: find(text, a, b) is the entry of the lowercased bytes text[a:b], or -1."""

    var slots: I64Ptr
    var cap: Int
    var keys: U8Ptr
    var key_offs: I64Ptr
    var flags: I64Ptr
    var codes: I64Ptr

    def __init__(out self, slots_addr: Int, cap: Int, keys_addr: Int, key_offs_addr: Int, flags_addr: Int,
                 codes_addr: Int):
        self.slots = I64Ptr(unsafe_from_address=slots_addr)
        self.cap = cap
        self.keys = U8Ptr(unsafe_from_address=keys_addr)
        self.key_offs = I64Ptr(unsafe_from_address=key_offs_addr)
        self.flags = I64Ptr(unsafe_from_address=flags_addr)
        self.codes = I64Ptr(unsafe_from_address=codes_addr)

    @always_inline
    def find(self, text: U8Ptr, a: Int, b: Int) -> Int:
        var h: UInt64 = 14695981039346656037
        for p in range(a, b):
            h = (h ^ UInt64(lower(text[unsafe_offset=p]))) * 1099511628211
        h ^= h >> 29
        var mask = self.cap - 1
        var slot = Int(h & UInt64(mask))
        while True:
            var e = Int(self.slots[unsafe_offset=slot])
            if e < 0:
                return -1
            var k0 = Int(self.key_offs[unsafe_offset=e])
            if Int(self.key_offs[unsafe_offset=e + 1]) - k0 == b - a:
                var same = True
                for q in range(b - a):
                    if self.keys[unsafe_offset=k0 + q] != lower(text[unsafe_offset=a + q]):
                        same = False
                        break
                if same:
                    return e
            slot = (slot + 1) & mask

    @always_inline
    def has(self, e: Int, flag: Int) -> Bool:
        return e >= 0 and (Int(self.flags[unsafe_offset=e]) & flag) != 0

    @always_inline
    def code(self, e: Int) -> Int:
        if e < 0:
            return 0
        return Int(self.codes[unsafe_offset=e])


def tokenize(text: U8Ptr, a0: Int, b0: Int, lex: Lexicon, ent: I64Ptr, bits: I64Ptr, max_tokens: Int,
             want_bits: Bool) -> Int:
    """VADER's tokens of text[a0:b0] into ent (entry or -1) and, with want_bits, bits (UPPER,
    NEGATED); their number, or -1 when more than max_tokens."""
    var n = 0
    var p = a0
    while p < b0:
        while p < b0 and is_space(text[unsafe_offset=p]):
            p += 1
        if p >= b0:
            break
        var a = p
        while p < b0 and not is_space(text[unsafe_offset=p]):
            p += 1
        var s = a
        var e = p
        while s < e and is_punct(text[unsafe_offset=s]):
            s += 1
        while e > s and is_punct(text[unsafe_offset=e - 1]):
            e -= 1
        if e - s <= 2:
            s = a
            e = p
        if n >= max_tokens:
            return -1
        var entry = lex.find(text, s, e)
        ent[unsafe_offset=n] = Int64(entry)
        n += 1
        if not want_bits:
            continue
        var has_upper = False
        var has_lower = False
        var nt = False
        for q in range(s, e):
            var c = text[unsafe_offset=q]
            if c >= 65 and c <= 90:
                has_upper = True
            elif c >= 97 and c <= 122:
                has_lower = True
            if q + 2 < e and lower(c) == 110 and text[unsafe_offset=q + 1] == 39 and lower(text[unsafe_offset=q + 2]) == 116:
                nt = True
        var bit = 0
        if has_upper and not has_lower:
            bit |= UPPER
        if nt or lex.has(entry, NEGATION):
            bit |= NEGATED
        bits[unsafe_offset=n - 1] = Int64(bit)
    return n


struct Words:
    """One row's tokens: entries, bits and the lexicon they index."""

    var ent: I64Ptr
    var bits: I64Ptr
    var n: Int

    def __init__(out self, ent: I64Ptr, bits: I64Ptr, n: Int):
        self.ent = ent
        self.bits = bits
        self.n = n

    @always_inline
    def e(self, i: Int) -> Int:
        return Int(self.ent[unsafe_offset=i])

    @always_inline
    def bit(self, i: Int, b: Int) -> Bool:
        return (Int(self.bits[unsafe_offset=i]) & b) != 0


def negation(w: Words, lex: Lexicon, v: Float64, step: Int, i: Int, n_scalar: Float64) -> Float64:
    """VADER's _negation_check for the token step + 1 places before i."""
    if step == 1:
        var c1 = lex.code(w.e(i - 1))
        if lex.code(w.e(i - 2)) == NEVER and (c1 == SO or c1 == THIS):
            return v * 1.25
        if lex.code(w.e(i - 2)) == WITHOUT and c1 == DOUBT:
            return v
    if step == 2:
        var c1 = lex.code(w.e(i - 1))
        var c2 = lex.code(w.e(i - 2))
        var c3 = lex.code(w.e(i - 3))
        if (c3 == NEVER and (c2 == SO or c2 == THIS)) or (c1 == SO or c1 == THIS):
            return v * 1.25
        if c3 == WITHOUT and (c2 == DOUBT or c1 == DOUBT):
            return v
    if w.bit(i - step - 1, NEGATED):
        return v * n_scalar
    return v


def valence(w: Words, lex: Lexicon, i: Int, cap_diff: Bool, lex_val: F64Ptr, boost: F64Ptr, c_incr: Float64,
            n_scalar: Float64) -> Float64:
    """Token i's sentiment: VADER's polarity_scores loop body and sentiment_valence."""
    var n = w.n
    var e = w.e(i)
    if lex.has(e, BOOSTER):
        return 0.0
    if lex.code(e) == KIND and i < n - 1 and lex.code(w.e(i + 1)) == OF:
        return 0.0
    if not lex.has(e, IN_LEXICON):
        return 0.0
    var base = lex_val[unsafe_offset=e]
    var v = base
    if lex.code(e) == NO and i != n - 1 and lex.has(w.e(i + 1), IN_LEXICON):
        v = 0.0
    var after_no = (i > 0 and lex.code(w.e(i - 1)) == NO) or (i > 1 and lex.code(w.e(i - 2)) == NO)
    if i > 2 and lex.code(w.e(i - 3)) == NO and (lex.code(w.e(i - 1)) == OR or lex.code(w.e(i - 1)) == NOR):
        after_no = True
    if after_no:
        v = base * n_scalar
    if w.bit(i, UPPER) and cap_diff:
        if v > 0.0:
            v = v + c_incr
        else:
            v = v - c_incr
    for step in range(3):
        var j = i - step - 1
        if j >= 0 and not lex.has(w.e(j), IN_LEXICON):
            var s: Float64 = 0.0
            if lex.has(w.e(j), BOOSTER):
                s = boost[unsafe_offset=w.e(j)]
                if v < 0.0:
                    s = s * -1.0
                if w.bit(j, UPPER) and cap_diff:
                    if v > 0.0:
                        s = s + c_incr
                    else:
                        s = s - c_incr
            if step == 1 and s != 0.0:
                s = s * 0.95
            if step == 2 and s != 0.0:
                s = s * 0.9
            v = v + s
            v = negation(w, lex, v, step, i, n_scalar)
    if i > 1 and not lex.has(w.e(i - 1), IN_LEXICON) and lex.code(w.e(i - 1)) == LEAST:
        var c2 = lex.code(w.e(i - 2))
        if c2 != AT and c2 != VERY:
            v = v * n_scalar
    elif i > 0 and not lex.has(w.e(i - 1), IN_LEXICON) and lex.code(w.e(i - 1)) == LEAST:
        v = v * n_scalar
    return v


def emphasis(text: U8Ptr, a: Int, b: Int) -> Float64:
    """VADER's _punctuation_emphasis: "!" (at most 4) x 0.292 plus the "?" amplifier."""
    var ep = 0
    var qm = 0
    for p in range(a, b):
        var c = text[unsafe_offset=p]
        if c == 33:
            ep += 1
        elif c == 63:
            qm += 1
    if ep > 4:
        ep = 4
    var amp = Float64(ep) * 0.292
    var q: Float64 = 0.0
    if qm > 1:
        if qm <= 3:
            q = Float64(qm) * 0.18
        else:
            q = 0.96
    return amp + q


def compound(w: Words, lex: Lexicon, text: U8Ptr, a: Int, b: Int, sent: F64Ptr, lex_val: F64Ptr, boost: F64Ptr,
             c_incr: Float64, n_scalar: Float64) -> Float64:
    var n = w.n
    if n == 0:
        return 0.0
    var n_upper = 0
    var bi = -1
    for i in range(n):
        if w.bit(i, UPPER):
            n_upper += 1
        if bi < 0 and lex.code(w.e(i)) == BUT:
            bi = i
    var cap_diff = n - n_upper > 0 and n - n_upper < n
    for i in range(n):
        sent[unsafe_offset=i] = valence(w, lex, i, cap_diff, lex_val, boost, c_incr, n_scalar)
    var total: Float64 = 0.0
    for i in range(n):
        var s = sent[unsafe_offset=i]
        if bi >= 0:
            if i < bi:
                s = s * 0.5
            elif i > bi:
                s = s * 1.5
        total = total + s
    var amp = emphasis(text, a, b)
    if total > 0.0:
        total = total + amp
    elif total < 0.0:
        total = total - amp
    var c = total / sqrt(total * total + 15.0)
    if c < -1.0:
        return -1.0
    if c > 1.0:
        return 1.0
    return c


@export
def sentiment(text_addr: Int, offs_addr: Int, B: Int, slots_addr: Int, cap: Int, keys_addr: Int, key_offs_addr: Int,
              flags_addr: Int, codes_addr: Int, valence_addr: Int, booster_addr: Int, c_incr: Float64,
              n_scalar: Float64, target: Float64, scratch_addr: Int, max_tokens: Int, out_addr: Int) abi("C") -> Int:
    """Set out[b] = 1 - |compound(row b) - target|. scratch: 3 * max_tokens int64/float64 slots."""
    var text = U8Ptr(unsafe_from_address=text_addr)
    var offs = I64Ptr(unsafe_from_address=offs_addr)
    var out = F64Ptr(unsafe_from_address=out_addr)
    var lex = Lexicon(slots_addr, cap, keys_addr, key_offs_addr, flags_addr, codes_addr)
    var ent = I64Ptr(unsafe_from_address=scratch_addr)
    var bits = ent.unsafe_offset(max_tokens)
    var sent = F64Ptr(unsafe_from_address=scratch_addr + 16 * max_tokens)
    var lex_val = F64Ptr(unsafe_from_address=valence_addr)
    var boost = F64Ptr(unsafe_from_address=booster_addr)
    for b in range(B):
        var a0 = Int(offs[unsafe_offset=b])
        var b0 = Int(offs[unsafe_offset=b + 1])
        var n = tokenize(text, a0, b0, lex, ent, bits, max_tokens, True)
        if n < 0:
            return -3
        var c = compound(Words(ent, bits, n), lex, text, a0, b0, sent, lex_val, boost, c_incr, n_scalar)
        var d = c - target
        if d < 0.0:
            d = 0.0 - d
        out[unsafe_offset=b] = 1.0 - d
    return 0


@export
def toxicity(text_addr: Int, offs_addr: Int, B: Int, slots_addr: Int, cap: Int, keys_addr: Int, key_offs_addr: Int,
             flags_addr: Int, codes_addr: Int, scratch_addr: Int, max_tokens: Int, out_addr: Int) abi("C") -> Int:
    """Set out[b] = -(tokens of row b on the list) / tokens, 0 without tokens. scratch: 2 * max_tokens int64."""
    var text = U8Ptr(unsafe_from_address=text_addr)
    var offs = I64Ptr(unsafe_from_address=offs_addr)
    var out = F64Ptr(unsafe_from_address=out_addr)
    var lex = Lexicon(slots_addr, cap, keys_addr, key_offs_addr, flags_addr, codes_addr)
    var ent = I64Ptr(unsafe_from_address=scratch_addr)
    var bits = ent.unsafe_offset(max_tokens)
    for b in range(B):
        var n = tokenize(text, Int(offs[unsafe_offset=b]), Int(offs[unsafe_offset=b + 1]), lex, ent, bits, max_tokens,
                         False)
        if n < 0:
            return -3
        var hits = 0
        for i in range(n):
            if lex.has(Int(ent[unsafe_offset=i]), TOXIC):
                hits += 1
        var frac: Float64 = 0.0
        if n > 0:
            frac = Float64(hits) / Float64(n)
        out[unsafe_offset=b] = 0.0 - frac
    return 0
