# The forward pass of materl's Mojo generation engine (materl/engines/mojo_engine.py) for
# Llama-family decoders (Llama, SmolLM2, Qwen2: RMSNorm, RoPE, grouped-query attention,
# SwiGLU MLP, optional linear biases, tied or untied LM head), float32.
#
# One call runs every layer for a set of rows; a row is one token of one request: its token id,
# its position and the address of its request's KV cache. Prefill (many rows of one request),
# decode (one row per request) and both at once are the same call. Each row attends to
# positions 0..pos of its own cache, so there is no padding and no mask.
#
# Threads: Python starts the call once per thread (thread = 0..threads-1; ctypes releases the
# GIL) and the threads meet at a barrier (llama/sync.mojo) between phases. Work is split by
# output columns (matmuls), by (row, kv head) (attention) or done by every thread for itself
# (RMSNorm into a private buffer). Which thread computes an element never changes how it is
# computed (llama/gemm.mojo), so results do not depend on the thread count either.
#
# Calling convention (materl/kernels/loader.py): @export ... abi("C") -> Int; 0 = success.
# The tables' layouts are mirrored in materl/engines/mojo_layout.py.

from llama.gemm import gemm, STORE, ACCUMULATE
from llama.layers import rmsnorm_row, rope_head, attend_group, silu_mul
from llama.sample import sample_row
from llama.sync import Barrier

comptime FPtr = Pointer[Float32, MutUntrackedOrigin]
comptime I64Ptr = Pointer[Int64, MutUntrackedOrigin]
comptime F64Ptr = Pointer[Float64, MutUntrackedOrigin]
comptime I32Ptr = Pointer[Int32, MutUntrackedOrigin]

# model table (int64)
comptime M_LAYERS = 0
comptime M_HIDDEN = 1
comptime M_HEADS = 2
comptime M_KV_HEADS = 3
comptime M_HEAD_DIM = 4
comptime M_INTER = 5
comptime M_VOCAB = 6
comptime M_EMBED = 7
comptime M_NORM = 8
comptime M_LM_HEAD = 9
comptime M_LM_BIAS = 10
comptime M_COS = 11
comptime M_SIN = 12
comptime M_ROPE_POSITIONS = 13
comptime M_LAYER0 = 16
comptime PER_LAYER = 16
# per-layer entries (addresses; 0 = no bias)
comptime IN_NORM = 0
comptime Q_W = 1
comptime Q_B = 2
comptime K_W = 3
comptime K_B = 4
comptime V_W = 5
comptime V_B = 6
comptime O_W = 7
comptime O_B = 8
comptime POST_NORM = 9
comptime GATE_W = 10
comptime GATE_B = 11
comptime UP_W = 12
comptime UP_B = 13
comptime DOWN_W = 14
comptime DOWN_B = 15

# step table (int64)
comptime S_ROWS = 0
comptime S_LOGIT_ROWS = 1
comptime S_THREADS = 2
comptime S_TOKENS = 3  # int64 (rows,)
comptime S_POSITIONS = 4  # int64 (rows,)
comptime S_KV = 5  # int64 (rows,): address of the row's KV cache
comptime S_KV_CAPACITY = 6  # int64 (rows,): positions that cache holds
comptime S_LOGIT_INDEX = 7  # int64 (logit_rows,): which rows get logits
comptime S_LOGITS = 8  # float32 (logit_rows, vocab)
comptime S_WORKSPACE = 9
comptime S_WORKSPACE_FLOATS = 10
comptime S_BARRIER = 11  # int64, zeroed before the threads start
comptime S_CONTEXT = 12  # the largest position + 1 of any row
comptime S_SAMPLE_F = 13  # float64 (logit_rows, 3): temperature, top_p, uniform; 0 = return logits only
comptime S_SAMPLE_I = 14  # int64 (logit_rows, 2): top_k, greedy
comptime S_TOKENS_OUT = 15  # int64 (logit_rows,)
comptime S_LOGPROBS_OUT = 16  # float64 (logit_rows,)

comptime ERR_TOKEN = 1
comptime ERR_POSITION = 2
comptime ERR_ROPE = 3
comptime ERR_WORKSPACE = 4
comptime ERR_THREAD = 5


struct Model:
    var tab: I64Ptr
    var layers: Int
    var H: Int
    var NH: Int
    var KVH: Int
    var D: Int
    var I: Int
    var V: Int

    def __init__(out self, addr: Int):
        self.tab = I64Ptr(unsafe_from_address=addr)
        self.layers = Int(self.tab[unsafe_offset=M_LAYERS])
        self.H = Int(self.tab[unsafe_offset=M_HIDDEN])
        self.NH = Int(self.tab[unsafe_offset=M_HEADS])
        self.KVH = Int(self.tab[unsafe_offset=M_KV_HEADS])
        self.D = Int(self.tab[unsafe_offset=M_HEAD_DIM])
        self.I = Int(self.tab[unsafe_offset=M_INTER])
        self.V = Int(self.tab[unsafe_offset=M_VOCAB])

    def at(self, i: Int) -> FPtr:
        return FPtr(unsafe_from_address=Int(self.tab[unsafe_offset=i]))

    def has(self, i: Int) -> Bool:
        return self.tab[unsafe_offset=i] != 0

    def w(self, layer: Int, which: Int) -> FPtr:
        return self.at(M_LAYER0 + layer * PER_LAYER + which)

    def b(self, layer: Int, which: Int) -> Bool:
        return self.has(M_LAYER0 + layer * PER_LAYER + which)


struct Step:
    var tab: I64Ptr
    var M: Int
    var R: Int
    var T: Int
    var ctx: Int
    var tokens: I64Ptr
    var pos: I64Ptr
    var kv: I64Ptr
    var cap: I64Ptr
    var logit_index: I64Ptr

    def __init__(out self, addr: Int):
        self.tab = I64Ptr(unsafe_from_address=addr)
        self.M = Int(self.tab[unsafe_offset=S_ROWS])
        self.R = Int(self.tab[unsafe_offset=S_LOGIT_ROWS])
        self.T = Int(self.tab[unsafe_offset=S_THREADS])
        self.ctx = Int(self.tab[unsafe_offset=S_CONTEXT])
        self.tokens = I64Ptr(unsafe_from_address=Int(self.tab[unsafe_offset=S_TOKENS]))
        self.pos = I64Ptr(unsafe_from_address=Int(self.tab[unsafe_offset=S_POSITIONS]))
        self.kv = I64Ptr(unsafe_from_address=Int(self.tab[unsafe_offset=S_KV]))
        self.cap = I64Ptr(unsafe_from_address=Int(self.tab[unsafe_offset=S_KV_CAPACITY]))
        self.logit_index = I64Ptr(unsafe_from_address=Int(self.tab[unsafe_offset=S_LOGIT_INDEX]))

    def p(self, r: Int) -> Int:
        return Int(self.pos[unsafe_offset=r])

    def cache(self, m: Model, r: Int, layer: Int, which: Int, g: Int) -> FPtr:
        """Position 0 of kv head g's keys (which=0) or values (1) in row r's cache.
        Cache layout: (layers, 2, kv_heads, capacity, head_dim) float32."""
        var cap = Int(self.cap[unsafe_offset=r])
        var base = Int(self.kv[unsafe_offset=r])
        return FPtr(unsafe_from_address=base + (((layer * 2 + which) * m.KVH + g) * cap) * m.D * 4)


struct Work:
    """Workspace offsets (floats); mirrored by mojo_layout.workspace_floats."""

    var x: FPtr
    var q: FPtr
    var attn: FPtr
    var gate: FPtr
    var up: FPtr
    var xn: FPtr  # this thread's
    var kvt: FPtr  # this thread's
    var scores: FPtr  # this thread's
    var cv: FPtr  # this thread's sampling scratch: vocab floats ...
    var ci: I32Ptr  # ... and vocab int32
    var floats: Int

    def __init__(out self, m: Model, s: Step, t: Int):
        var base = Int(s.tab[unsafe_offset=S_WORKSPACE])
        var rows = s.M if s.M > s.R else s.R
        var G = m.NH // m.KVH
        var shared = s.M * (m.H + 2 * m.NH * m.D + 2 * m.I)  # x, q, attn, gate, up
        var private = rows * m.H + s.M * m.D + G * (s.ctx + 1) + 2 * m.V
        var at = 0
        self.x = FPtr(unsafe_from_address=base)
        at += s.M * m.H
        self.q = FPtr(unsafe_from_address=base + at * 4)
        at += s.M * m.NH * m.D
        self.attn = FPtr(unsafe_from_address=base + at * 4)
        at += s.M * m.NH * m.D
        self.gate = FPtr(unsafe_from_address=base + at * 4)
        at += s.M * m.I
        self.up = FPtr(unsafe_from_address=base + at * 4)
        at += s.M * m.I
        at += t * private
        self.xn = FPtr(unsafe_from_address=base + at * 4)
        at += rows * m.H
        self.kvt = FPtr(unsafe_from_address=base + at * 4)
        at += s.M * m.D
        self.scores = FPtr(unsafe_from_address=base + at * 4)
        at += G * (s.ctx + 1)
        self.cv = FPtr(unsafe_from_address=base + at * 4)
        at += m.V
        self.ci = I32Ptr(unsafe_from_address=base + at * 4)
        self.floats = shared + s.T * private


def split(n: Int, T: Int, t: Int) -> Tuple[Int, Int]:
    """Thread t's share [lo, hi) of n items, in order."""
    return (n * t // T, n * (t + 1) // T)


def check(m: Model, s: Step, w: Work, t: Int) -> Int:
    """The same checks in every thread, before the first barrier, so all return together."""
    if t < 0 or t >= s.T:
        return ERR_THREAD
    if w.floats > Int(s.tab[unsafe_offset=S_WORKSPACE_FLOATS]):
        return ERR_WORKSPACE
    var rope = Int(m.tab[unsafe_offset=M_ROPE_POSITIONS])
    for r in range(s.M):
        var tok = Int(s.tokens[unsafe_offset=r])
        if tok < 0 or tok >= m.V:
            return ERR_TOKEN
        var p = s.p(r)
        if p < 0 or p >= Int(s.cap[unsafe_offset=r]) or p >= s.ctx:
            return ERR_POSITION
        if p >= rope:
            return ERR_ROPE
    return 0


def qkv_phase(m: Model, s: Step, w: Work, t: Int, layer: Int):
    """The q, k, v projections of every row, RoPE on q and k, k and v written into the rows' caches.
    Split by heads: unit u < NH is q head u, then the kv heads' keys, then their values."""
    var D = m.D
    var cos = m.at(M_COS)
    var sin = m.at(M_SIN)
    var units = split(m.NH + 2 * m.KVH, s.T, t)
    for u in range(units[0], units[1]):
        if u < m.NH:
            var y = w.q.unsafe_offset(u * D)
            gemm(w.xn, m.H, s.M, m.w(layer, Q_W), m.H, u * D, (u + 1) * D, y, m.NH * D, m.w(layer, Q_B),
                 m.b(layer, Q_B), STORE)
            for r in range(s.M):
                var p = s.p(r)
                rope_head(y.unsafe_offset(r * m.NH * D), cos.unsafe_offset(p * D), sin.unsafe_offset(p * D), D)
            continue
        var is_v = u >= m.NH + m.KVH
        var g = u - m.NH - (m.KVH if is_v else 0)
        var wi = V_W if is_v else K_W
        gemm(w.xn, m.H, s.M, m.w(layer, wi), m.H, g * D, (g + 1) * D, w.kvt, D, m.w(layer, wi + 1),
             m.b(layer, wi + 1), STORE)
        for r in range(s.M):
            var p = s.p(r)
            var src = w.kvt.unsafe_offset(r * D)
            if not is_v:
                rope_head(src, cos.unsafe_offset(p * D), sin.unsafe_offset(p * D), D)
            var dst = s.cache(m, r, layer, 1 if is_v else 0, g).unsafe_offset(p * D)
            for d in range(D):
                dst[unsafe_offset=d] = src[unsafe_offset=d]


def attention_phase(m: Model, s: Step, w: Work, t: Int, layer: Int, scale: Float32):
    var G = m.NH // m.KVH
    var width = m.NH * m.D
    var unit = t
    while unit < s.M * m.KVH:  # (row, kv head) pairs, dealt round-robin (prefill rows differ in length)
        var r = unit // m.KVH
        var g = unit % m.KVH
        var at = r * width + g * G * m.D
        attend_group(w.q.unsafe_offset(at), w.attn.unsafe_offset(at), s.cache(m, r, layer, 0, g),
                     s.cache(m, r, layer, 1, g), s.p(r) + 1, G, m.D, scale, w.scores)
        unit += s.T


def mlp_phase(m: Model, s: Step, w: Work, t: Int, layer: Int):
    """The gate and up projections of this thread's columns, then silu(gate) * up in place."""
    var cols = split(m.I, s.T, t)
    var c0 = cols[0]
    var n = cols[1] - c0
    gemm(w.xn, m.H, s.M, m.w(layer, GATE_W), m.H, c0, cols[1], w.gate.unsafe_offset(c0), m.I, m.w(layer, GATE_B),
         m.b(layer, GATE_B), STORE)
    gemm(w.xn, m.H, s.M, m.w(layer, UP_W), m.H, c0, cols[1], w.up.unsafe_offset(c0), m.I, m.w(layer, UP_B),
         m.b(layer, UP_B), STORE)
    for r in range(s.M):
        silu_mul(w.gate.unsafe_offset(r * m.I + c0), w.up.unsafe_offset(r * m.I + c0), n)


def norm_rows(m: Model, s: Step, w: Work, weight: FPtr, eps: Float32):
    for r in range(s.M):
        rmsnorm_row(w.x.unsafe_offset(r * m.H), w.xn.unsafe_offset(r * m.H), weight, m.H, eps)


def layer_forward(m: Model, s: Step, w: Work, t: Int, layer: Int, eps: Float32, scale: Float32, mut bar: Barrier):
    var hcols = split(m.H, s.T, t)
    norm_rows(m, s, w, m.w(layer, IN_NORM), eps)
    qkv_phase(m, s, w, t, layer)
    bar.wait()
    attention_phase(m, s, w, t, layer, scale)
    bar.wait()
    var attn_width = m.NH * m.D
    gemm(w.attn, attn_width, s.M, m.w(layer, O_W), attn_width, hcols[0], hcols[1], w.x.unsafe_offset(hcols[0]), m.H,
         m.w(layer, O_B), m.b(layer, O_B), ACCUMULATE)
    bar.wait()
    norm_rows(m, s, w, m.w(layer, POST_NORM), eps)
    mlp_phase(m, s, w, t, layer)
    bar.wait()
    gemm(w.gate, m.I, s.M, m.w(layer, DOWN_W), m.I, hcols[0], hcols[1], w.x.unsafe_offset(hcols[0]), m.H,
         m.w(layer, DOWN_B), m.b(layer, DOWN_B), ACCUMULATE)
    bar.wait()


@export
def llama_forward(model_addr: Int, step_addr: Int, thread: Int, eps: Float64, scale: Float64) abi("C") -> Int:
    """Thread ``thread``'s part of one forward pass; every thread of the step must be called."""
    var m = Model(model_addr)
    var s = Step(step_addr)
    var w = Work(m, s, thread)
    var err = check(m, s, w, thread)
    if err != 0:
        return err
    var bar = Barrier(Int(s.tab[unsafe_offset=S_BARRIER]), s.T)
    var embed = m.at(M_EMBED)
    var r = thread
    while r < s.M:
        var src = embed.unsafe_offset(Int(s.tokens[unsafe_offset=r]) * m.H)
        var dst = w.x.unsafe_offset(r * m.H)
        for k in range(m.H):
            dst[unsafe_offset=k] = src[unsafe_offset=k]
        r += s.T
    bar.wait()
    var eps32 = Float32(eps)
    var scale32 = Float32(scale)
    for layer in range(m.layers):
        layer_forward(m, s, w, thread, layer, eps32, scale32, bar)
    for i in range(s.R):  # the final norm of the rows that get logits, then the LM head's columns
        var row = Int(s.logit_index[unsafe_offset=i])
        rmsnorm_row(w.x.unsafe_offset(row * m.H), w.xn.unsafe_offset(i * m.H), m.at(M_NORM), m.H, eps32)
    var vcols = split(m.V, s.T, thread)
    var logits = FPtr(unsafe_from_address=Int(s.tab[unsafe_offset=S_LOGITS]))
    gemm(w.xn, m.H, s.R, m.at(M_LM_HEAD), m.H, vcols[0], vcols[1], logits.unsafe_offset(vcols[0]), m.V,
         m.at(M_LM_BIAS), m.has(M_LM_BIAS), STORE)
    if s.tab[unsafe_offset=S_SAMPLE_F] != 0:
        bar.wait()
        sample_rows(m, s, w, thread, logits)
    return 0


def sample_rows(m: Model, s: Step, w: Work, t: Int, logits: FPtr):
    """One token and its log-prob per logit row (llama/sample.mojo), rows dealt round-robin."""
    var pf = F64Ptr(unsafe_from_address=Int(s.tab[unsafe_offset=S_SAMPLE_F]))
    var pi = I64Ptr(unsafe_from_address=Int(s.tab[unsafe_offset=S_SAMPLE_I]))
    var tokens = I64Ptr(unsafe_from_address=Int(s.tab[unsafe_offset=S_TOKENS_OUT]))
    var logprobs = F64Ptr(unsafe_from_address=Int(s.tab[unsafe_offset=S_LOGPROBS_OUT]))
    var i = t
    while i < s.R:
        var got = sample_row(logits.unsafe_offset(i * m.V), m.V, Float32(pf[unsafe_offset=3 * i]),
                             Int(pi[unsafe_offset=2 * i]), pf[unsafe_offset=3 * i + 1], pi[unsafe_offset=2 * i + 1] != 0,
                             pf[unsafe_offset=3 * i + 2], w.cv, w.ci)
        tokens[unsafe_offset=i] = Int64(got[0])
        logprobs[unsafe_offset=i] = Float64(got[1])
        i += s.T


@export
def llama_sample(logits_addr: Int, R: Int, V: Int, f64_addr: Int, i64_addr: Int, tokens_addr: Int, logprobs_addr: Int,
                 scratch_addr: Int) abi("C") -> Int:
    """Sample rows of given logits (R, V) as the forward's last phase does; scratch: 2 * V floats.
    The per-row inputs and outputs are laid out as in the step table (S_SAMPLE_F ...)."""
    var logits = FPtr(unsafe_from_address=logits_addr)
    var pf = F64Ptr(unsafe_from_address=f64_addr)
    var pi = I64Ptr(unsafe_from_address=i64_addr)
    var tokens = I64Ptr(unsafe_from_address=tokens_addr)
    var logprobs = F64Ptr(unsafe_from_address=logprobs_addr)
    for i in range(R):
        var got = sample_row(logits.unsafe_offset(i * V), V, Float32(pf[unsafe_offset=3 * i]), Int(pi[unsafe_offset=2 * i]),
                             pf[unsafe_offset=3 * i + 1], pi[unsafe_offset=2 * i + 1] != 0, pf[unsafe_offset=3 * i + 2],
                             FPtr(unsafe_from_address=scratch_addr), I32Ptr(unsafe_from_address=scratch_addr + 4 * V))
        tokens[unsafe_offset=i] = Int64(got[0])
        logprobs[unsafe_offset=i] = Float64(got[1])
    return 0
