# Lexicon rewards on completion text: VADER sentiment and profanity-list toxicity.
#
# Input: the completions' UTF-8 bytes concatenated (uint8, then 8 zero bytes) with B + 1 int64
# offsets; a lexicon as an open-addressing hash table (materl/kernels/text_rewards.py builds it
# from the packaged word lists): `filter` (1024 uint64: a bit for each word's hash), `slots` (cap
# int64, entry index or -1, linear probing from `word_hash` of the lowercased word), `hashes` (cap
# int64, the hash of each slot's word, compared before its bytes), the entries' lowercased bytes
# (`keys`, E + 1 offsets `key_offs`), `info` (flags | code << 8), `valence`, `booster`.
# Python reference: materl/ops/text_rewards.py, whose docstring defines tokens and rules; the
# results are bit-identical (the same float64 operations in the same order, built without FMA).
#
# Tokens are found on bit masks, one bit a byte (`classify`: ASCII whitespace, punctuation,
# capitals, small letters; 64 bytes a SIMD step): a token's start, end and punctuation-stripped
# span are bit scans, and only its kept bytes are read again, for the hash. Bytes are read one at
# a time only in tokens that hold punctuation (for "!", "?" and "n't") or when the hash matches.
#
# Calling convention (materl/kernels/loader.py): addresses and sizes as Int, reals as Float64;
# 0 = success, -3 = token scratch too small.

from std.bit import count_leading_zeros, count_trailing_zeros
from std.math import sqrt
from std.memory import bitcast, pack_bits

comptime I64Ptr = Pointer[Int64, MutUntrackedOrigin]
comptime F64Ptr = Pointer[Float64, MutUntrackedOrigin]
comptime U8Ptr = Pointer[UInt8, MutUntrackedOrigin]
comptime U64Ptr = Pointer[UInt64, MutUntrackedOrigin]
comptime Bytes64 = SIMD[DType.uint8, 64]

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
# token word: the entry's info (flags | code << 8, 0 when not found) | these bits
comptime T_UPPER = 1 << 16
comptime T_NT = 1 << 17
comptime FNV_OFFSET: UInt64 = 14695981039346656037
comptime FNV_PRIME: UInt64 = 1099511628211
comptime MIX: UInt64 = 0x9E3779B97F4A7C15


@always_inline
def lower(c: UInt8) -> UInt8:
    if c >= 65 and c <= 90:
        return c + 32
    return c


@always_inline
def lower8(x: UInt64) -> UInt64:
    """ASCII-lowercase 8 bytes at once (bytes.lower()): +0x20 on each byte in A-Z."""
    var heptets = x & 0x7F7F7F7F7F7F7F7F
    var from_a = heptets + 0x3F3F3F3F3F3F3F3F  # high bit set where the byte's low 7 bits >= 0x41
    var past_z = heptets + 0x2525252525252525  # ... >= 0x5B
    return x | (((from_a ^ past_z) & ~x & 0x8080808080808080) >> 2)


@always_inline
def word_hash(text: U8Ptr, s: Int, e: Int) -> UInt64:
    """materl.kernels.text_rewards.fnv1a of the lowercased text[s:e]: FNV-1a over its
    little-endian 8-byte chunks (the last one zero-filled: the text is padded with 8 zero bytes
    so a chunk may be read whole), then its length, then a multiply-xorshift finish."""
    var h = FNV_OFFSET
    var q = s
    while q + 8 <= e:
        h = (h ^ lower8(bitcast[DType.uint64, 1](text.unsafe_load[width=8](q)))) * FNV_PRIME
        q += 8
    if q < e:
        var chunk = lower8(bitcast[DType.uint64, 1](text.unsafe_load[width=8](q))) & low_bits(8 * (e - q))
        h = (h ^ chunk) * FNV_PRIME
    h = (h ^ UInt64(e - s)) * FNV_PRIME
    h ^= h >> 32
    h *= MIX
    return h ^ (h >> 29)


@always_inline
def in_range(v: Bytes64, lo: Int, count: Int) -> SIMD[DType.bool, 64]:
    """Whether lo <= v < lo + count, per byte (one unsigned compare)."""
    return (v - Bytes64(lo)).lt(Bytes64(count))


@always_inline
def in_range1(c: UInt8, lo: Int, count: Int) -> Bool:
    return Int(c - UInt8(lo)) < count


struct Masks(ImplicitlyCopyable):
    """One bit per byte of the text (bit p % 64 of word p // 64), with 2 spare zero words:
    ASCII whitespace (bytes.split), punctuation (string.punctuation), capitals, small letters."""

    var space: U64Ptr
    var punct: U64Ptr
    var cap: U64Ptr
    var small: U64Ptr

    def __init__(out self, addr: Int, words: Int):
        self.space = U64Ptr(unsafe_from_address=addr)
        self.punct = self.space.unsafe_offset(words)
        self.cap = self.space.unsafe_offset(2 * words)
        self.small = self.space.unsafe_offset(3 * words)

    def classify[CASE: Bool](self, text: U8Ptr, nbytes: Int):
        var full = nbytes // 64
        for i in range(full):
            var v = text.unsafe_load[width=64](i * 64)
            self.space[unsafe_offset=i] = pack_bits[DType.uint64](v.eq(Bytes64(32)) | in_range(v, 9, 5))
            self.punct[unsafe_offset=i] = pack_bits[DType.uint64](
                in_range(v, 33, 15) | in_range(v, 58, 7) | in_range(v, 91, 6) | in_range(v, 123, 4))
            comptime if CASE:
                self.cap[unsafe_offset=i] = pack_bits[DType.uint64](in_range(v, 65, 26))
                self.small[unsafe_offset=i] = pack_bits[DType.uint64](in_range(v, 97, 26))
        var sp: UInt64 = 0
        var pu: UInt64 = 0
        var ca: UInt64 = 0
        var sm: UInt64 = 0
        for q in range(nbytes - full * 64):
            var c = text[unsafe_offset=full * 64 + q]
            var bit = UInt64(1) << UInt64(q)
            if c == 32 or in_range1(c, 9, 5):
                sp |= bit
            if in_range1(c, 33, 15) or in_range1(c, 58, 7) or in_range1(c, 91, 6) or in_range1(c, 123, 4):
                pu |= bit
            if in_range1(c, 65, 26):
                ca |= bit
            if in_range1(c, 97, 26):
                sm |= bit
        for i in range(full, full + 2):
            self.space[unsafe_offset=i] = sp
            self.punct[unsafe_offset=i] = pu
            comptime if CASE:
                self.cap[unsafe_offset=i] = ca
                self.small[unsafe_offset=i] = sm
            sp = 0
            pu = 0
            ca = 0
            sm = 0


@always_inline
def window(m: U64Ptr, p: Int) -> UInt64:
    """The 64 bits of m from byte p on (branch-free: the second word moves in by 64 - k bits)."""
    var i = p >> 6
    var k = UInt64(p & 63)
    return (m[unsafe_offset=i] >> k) | ((m[unsafe_offset=i + 1] << 1) << (63 - k))


@always_inline
def low_bits(n: Int) -> UInt64:
    if n >= 64:
        return ~UInt64(0)
    return (UInt64(1) << UInt64(n)) - 1


@always_inline
def first[SET: Bool](m: U64Ptr, a: Int, b: Int) -> Int:
    """The first byte in [a, b) whose bit is SET, or b."""
    var p = a
    while p < b:
        var w = window(m, p)
        comptime if not SET:
            w = ~w
        w &= low_bits(b - p)
        if w != 0:
            return p + Int(count_trailing_zeros(w))
        p += 64
    return b


@always_inline
def last_clear(m: U64Ptr, a: Int, b: Int) -> Int:
    """1 + the last byte in [a, b) whose bit is clear, or a."""
    var e = b
    while e > a:
        var q = e - 64
        if q < a:
            q = a
        var w = ~window(m, q) & low_bits(e - q)
        if w != 0:
            return q + 64 - Int(count_leading_zeros(w))
        e = q
    return a


@always_inline
def any_set(m: U64Ptr, a: Int, b: Int) -> Bool:
    return first[True](m, a, b) < b


struct Lexicon:
    """The word table: find(text, s, e) is the entry of the lowercased bytes text[s:e], or -1.
    `filter` has bit h >> 32 & 65535 set for the hash h of every word, so a word it lacks costs
    no probe."""

    var filter: U64Ptr
    var slots: I64Ptr
    var hashes: I64Ptr
    var cap: Int
    var keys: U8Ptr
    var key_offs: I64Ptr
    var info: I64Ptr

    def __init__(out self, filter_addr: Int, slots_addr: Int, hashes_addr: Int, cap: Int, keys_addr: Int,
                 key_offs_addr: Int, info_addr: Int):
        self.filter = U64Ptr(unsafe_from_address=filter_addr)
        self.slots = I64Ptr(unsafe_from_address=slots_addr)
        self.hashes = I64Ptr(unsafe_from_address=hashes_addr)
        self.cap = cap
        self.keys = U8Ptr(unsafe_from_address=keys_addr)
        self.key_offs = I64Ptr(unsafe_from_address=key_offs_addr)
        self.info = I64Ptr(unsafe_from_address=info_addr)

    @always_inline
    def find(self, text: U8Ptr, s: Int, e: Int) -> Int:
        var h = word_hash(text, s, e)
        if ((self.filter[unsafe_offset=Int((h >> 38) & 1023)] >> ((h >> 32) & 63)) & 1) == 0:
            return -1  # most words of a text are on no list: one predictable branch on an 8 KiB bitmap
        var mask = self.cap - 1
        var slot = Int(h & UInt64(mask))
        var hs = h.cast[DType.int64]()
        while True:
            var ent = Int(self.slots[unsafe_offset=slot])
            if ent < 0:
                return -1
            if self.hashes[unsafe_offset=slot] == hs:
                var k0 = Int(self.key_offs[unsafe_offset=ent])
                if Int(self.key_offs[unsafe_offset=ent + 1]) - k0 == e - s:
                    var same = True
                    for q in range(e - s):
                        if self.keys[unsafe_offset=k0 + q] != lower(text[unsafe_offset=s + q]):
                            same = False
                            break
                    if same:
                        return ent
            slot = (slot + 1) & mask

    @always_inline
    def word(self, ent: Int) -> Int:
        """The token word of entry ent (0 for -1)."""
        if ent < 0:
            return 0
        return Int(self.info[unsafe_offset=ent])


struct Scanner:
    """VADER's tokens of text[p:end], one at a time: next() moves to the next token and sets its
    bytes [a, b) and its kept span [s, e) (punctuation stripped unless fewer than 3 bytes would
    remain)."""

    var m: Masks
    var p: Int
    var end: Int
    var a: Int
    var b: Int
    var s: Int
    var e: Int

    def __init__(out self, m: Masks, a: Int, b: Int):
        self.m = m
        self.p = a
        self.end = b
        self.a = a
        self.b = a
        self.s = a
        self.e = a

    @always_inline
    def next(mut self) -> Bool:
        var end = self.end
        var a = first[False](self.m.space, self.p, end)
        if a >= end:
            self.p = end
            return False
        var b: Int
        var s: Int
        var e: Int
        var room = end - a
        var sp = window(self.m.space, a) & low_bits(room)
        if sp != 0 or room <= 64:  # the token ends within 64 bytes: one window answers for it
            var n = room
            if sp != 0:
                n = Int(count_trailing_zeros(sp))
            b = a + n
            var kept = ~window(self.m.punct, a) & low_bits(n)
            s = a + Int(count_trailing_zeros(kept))  # a + 64 when all punctuation
            e = a + 64 - Int(count_leading_zeros(kept))
        else:
            b = first[True](self.m.space, a, end)
            s = first[False](self.m.punct, a, b)
            e = last_clear(self.m.punct, s, b)
        if e - s <= 2:
            s = a  # kept whole
            e = b
        self.p = b
        self.a = a
        self.b = b
        self.s = s
        self.e = e
        return True

    @always_inline
    def upper(self) -> Bool:
        """Python's bytes.isupper() of the token: a capital and no small letter (punctuation has no case,
        so the whole token answers for its kept span)."""
        return any_set(self.m.cap, self.a, self.b) and not any_set(self.m.small, self.a, self.b)


struct Words:
    """One row's tokens: entries and token words (info | T_UPPER | T_NT)."""

    var ent: I64Ptr
    var tok: I64Ptr
    var n: Int

    def __init__(out self, ent: I64Ptr, tok: I64Ptr, n: Int):
        self.ent = ent
        self.tok = tok
        self.n = n

    @always_inline
    def e(self, i: Int) -> Int:
        return Int(self.ent[unsafe_offset=i])

    @always_inline
    def has(self, i: Int, bit: Int) -> Bool:
        return (Int(self.tok[unsafe_offset=i]) & bit) != 0

    @always_inline
    def code(self, i: Int) -> Int:
        return (Int(self.tok[unsafe_offset=i]) >> 8) & 255


def negation(w: Words, v: Float64, step: Int, i: Int, n_scalar: Float64) -> Float64:
    """VADER's _negation_check for the token step + 1 places before i."""
    if step == 1:
        var c1 = w.code(i - 1)
        if w.code(i - 2) == NEVER and (c1 == SO or c1 == THIS):
            return v * 1.25
        if w.code(i - 2) == WITHOUT and c1 == DOUBT:
            return v
    if step == 2:
        var c1 = w.code(i - 1)
        var c2 = w.code(i - 2)
        var c3 = w.code(i - 3)
        if (c3 == NEVER and (c2 == SO or c2 == THIS)) or (c1 == SO or c1 == THIS):
            return v * 1.25
        if c3 == WITHOUT and (c2 == DOUBT or c1 == DOUBT):
            return v
    if w.has(i - step - 1, NEGATION | T_NT):
        return v * n_scalar
    return v


def valence(w: Words, i: Int, cap_diff: Bool, lex_val: F64Ptr, boost: F64Ptr, c_incr: Float64,
            n_scalar: Float64) -> Float64:
    """Token i's sentiment: VADER's polarity_scores loop body and sentiment_valence."""
    var n = w.n
    if w.has(i, BOOSTER):
        return 0.0
    if w.code(i) == KIND and i < n - 1 and w.code(i + 1) == OF:
        return 0.0
    if not w.has(i, IN_LEXICON):
        return 0.0
    var base = lex_val[unsafe_offset=w.e(i)]
    var v = base
    if w.code(i) == NO and i != n - 1 and w.has(i + 1, IN_LEXICON):
        v = 0.0
    var after_no = (i > 0 and w.code(i - 1) == NO) or (i > 1 and w.code(i - 2) == NO)
    if i > 2 and w.code(i - 3) == NO and (w.code(i - 1) == OR or w.code(i - 1) == NOR):
        after_no = True
    if after_no:
        v = base * n_scalar
    if w.has(i, T_UPPER) and cap_diff:
        if v > 0.0:
            v = v + c_incr
        else:
            v = v - c_incr
    for step in range(3):
        var j = i - step - 1
        if j >= 0 and not w.has(j, IN_LEXICON):
            var s: Float64 = 0.0
            if w.has(j, BOOSTER):
                s = boost[unsafe_offset=w.e(j)]
                if v < 0.0:
                    s = s * -1.0
                if w.has(j, T_UPPER) and cap_diff:
                    if v > 0.0:
                        s = s + c_incr
                    else:
                        s = s - c_incr
            if step == 1 and s != 0.0:
                s = s * 0.95
            if step == 2 and s != 0.0:
                s = s * 0.9
            v = v + s
            v = negation(w, v, step, i, n_scalar)
    if i > 1 and not w.has(i - 1, IN_LEXICON) and w.code(i - 1) == LEAST:
        var c2 = w.code(i - 2)
        if c2 != AT and c2 != VERY:
            v = v * n_scalar
    elif i > 0 and not w.has(i - 1, IN_LEXICON) and w.code(i - 1) == LEAST:
        v = v * n_scalar
    return v


def emphasis(bangs: Int, quests: Int) -> Float64:
    """VADER's _punctuation_emphasis: "!" (at most 4) x 0.292 plus the "?" amplifier."""
    var ep = bangs
    if ep > 4:
        ep = 4
    var amp = Float64(ep) * 0.292
    var q: Float64 = 0.0
    if quests > 1:
        if quests <= 3:
            q = Float64(quests) * 0.18
        else:
            q = 0.96
    return amp + q


def compound(w: Words, amp: Float64, sent: F64Ptr, lex_val: F64Ptr, boost: F64Ptr, c_incr: Float64,
             n_scalar: Float64) -> Float64:
    var n = w.n
    if n == 0:
        return 0.0
    var n_upper = 0
    var bi = -1
    for i in range(n):
        if w.has(i, T_UPPER):
            n_upper += 1
        if bi < 0 and w.code(i) == BUT:
            bi = i
    var cap_diff = n - n_upper > 0 and n - n_upper < n
    for i in range(n):
        sent[unsafe_offset=i] = valence(w, i, cap_diff, lex_val, boost, c_incr, n_scalar)
    var total: Float64 = 0.0
    for i in range(n):
        var s = sent[unsafe_offset=i]
        if bi >= 0:
            if i < bi:
                s = s * 0.5
            elif i > bi:
                s = s * 1.5
        total = total + s
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


def punctuated(text: U8Ptr, sc: Scanner, mut bangs: Int, mut quests: Int) -> Bool:
    """Count the "!" and "?" of a token holding punctuation; whether its kept span contains "n't"."""
    var nt = False
    for q in range(sc.a, sc.b):
        var c = text[unsafe_offset=q]
        if c == 33:
            bangs += 1
        elif c == 63:
            quests += 1
        elif c == 39 and q > sc.s and q + 1 < sc.e:
            if lower(text[unsafe_offset=q - 1]) == 110 and lower(text[unsafe_offset=q + 1]) == 116:
                nt = True
    return nt


@export
def sentiment(text_addr: Int, offs_addr: Int, B: Int, masks_addr: Int, mask_words: Int, filter_addr: Int,
              slots_addr: Int, hashes_addr: Int, cap: Int, keys_addr: Int, key_offs_addr: Int, info_addr: Int,
              valence_addr: Int, booster_addr: Int, c_incr: Float64, n_scalar: Float64, target: Float64,
              scratch_addr: Int, max_tokens: Int, out_addr: Int) abi("C") -> Int:
    """Set out[b] = 1 - |compound(row b) - target|. masks: 4 * mask_words uint64 (mask_words =
    bytes // 64 + 2); scratch: 3 * max_tokens int64/float64 slots."""
    var text = U8Ptr(unsafe_from_address=text_addr)
    var offs = I64Ptr(unsafe_from_address=offs_addr)
    var out = F64Ptr(unsafe_from_address=out_addr)
    var m = Masks(masks_addr, mask_words)
    m.classify[True](text, Int(offs[unsafe_offset=B]))
    var lex = Lexicon(filter_addr, slots_addr, hashes_addr, cap, keys_addr, key_offs_addr, info_addr)
    var ent = I64Ptr(unsafe_from_address=scratch_addr)
    var tok = ent.unsafe_offset(max_tokens)
    var sent = F64Ptr(unsafe_from_address=scratch_addr + 16 * max_tokens)
    var lex_val = F64Ptr(unsafe_from_address=valence_addr)
    var boost = F64Ptr(unsafe_from_address=booster_addr)
    for b in range(B):
        var sc = Scanner(m, Int(offs[unsafe_offset=b]), Int(offs[unsafe_offset=b + 1]))
        var n = 0
        var bangs = 0
        var quests = 0
        while sc.next():
            if n >= max_tokens:
                return -3
            var found = lex.find(text, sc.s, sc.e)
            var t = lex.word(found)
            if sc.upper():
                t |= T_UPPER
            if any_set(m.punct, sc.a, sc.b) and punctuated(text, sc, bangs, quests):
                t |= T_NT
            ent[unsafe_offset=n] = Int64(found)
            tok[unsafe_offset=n] = Int64(t)
            n += 1
        var c = compound(Words(ent, tok, n), emphasis(bangs, quests), sent, lex_val, boost, c_incr, n_scalar)
        var d = c - target
        if d < 0.0:
            d = 0.0 - d
        out[unsafe_offset=b] = 1.0 - d
    return 0


@export
def toxicity(text_addr: Int, offs_addr: Int, B: Int, masks_addr: Int, mask_words: Int, filter_addr: Int,
             slots_addr: Int, hashes_addr: Int, cap: Int, keys_addr: Int, key_offs_addr: Int, info_addr: Int,
             out_addr: Int) abi("C") -> Int:
    """Set out[b] = -(tokens of row b on the list) / tokens, 0 without tokens. masks: 2 *
    mask_words uint64 (whitespace and punctuation only); the tokens are counted as they are read."""
    var text = U8Ptr(unsafe_from_address=text_addr)
    var offs = I64Ptr(unsafe_from_address=offs_addr)
    var out = F64Ptr(unsafe_from_address=out_addr)
    var m = Masks(masks_addr, mask_words)
    m.classify[False](text, Int(offs[unsafe_offset=B]))
    var lex = Lexicon(filter_addr, slots_addr, hashes_addr, cap, keys_addr, key_offs_addr, info_addr)
    for b in range(B):
        var sc = Scanner(m, Int(offs[unsafe_offset=b]), Int(offs[unsafe_offset=b + 1]))
        var n = 0
        var hits = 0
        while sc.next():
            n += 1
            if (lex.word(lex.find(text, sc.s, sc.e)) & TOXIC) != 0:
                hits += 1
        var frac: Float64 = 0.0
        if n > 0:
            frac = Float64(hits) / Float64(n)
        out[unsafe_offset=b] = 0.0 - frac
    return 0
