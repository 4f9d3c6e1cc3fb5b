# The forward pass of materl's Mojo generation engine (materl/engines/mojo_engine.py) for
# Llama-family decoders (Llama, SmolLM2, Qwen2: RMSNorm, RoPE, grouped-query attention,
# SwiGLU MLP, optional linear biases, tied or untied LM head), float32.
#
# One call runs every layer for a set of rows; a row is one token of one request: its token id,
# its position and the address of its request's KV cache. Prefill (many rows of one request),
# decode (one row per request) and both at once are the same call. Each row attends to
# positions 0..pos of its own cache, so there is no padding and no mask. A mirror writes a row's
# keys and values into a second cache as well (another request whose prompt shares that
# position's prefix), so a shared prefix is computed once.
#
# Threads: Python starts the call once per thread (thread = 0..threads-1; ctypes releases the
# GIL). The pass is a sequence of phases cut into chunks that threads take from a shared ticket
# counter (llama/sync.mojo): output columns of a matmul, (row, kv head) pairs of attention, rows
# of sampling. RMSNorm feeding a matmul is done by each thread for itself, into its own buffer.
# Which thread computes an element never changes how it is computed (llama/gemm.mojo), so
# results depend neither on the thread count nor on which thread ran what.
#
# Calling convention (materl/kernels/loader.py): @export ... abi("C") -> Int; 0 = success.
# The tables' layouts are mirrored in materl/engines/mojo_model.py (the model table, M_*) and
# materl/engines/mojo_forward.py (the step table, S_*, and the scratch size of Work: workspace_floats).

from llama.gemm import gemm, STORE, ACCUMULATE
from llama.layers import rmsnorm_row, rope_head, attend_group, silu_mul
from llama.sample import sample_row
from llama.sync import Tickets

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
comptime S_COUNTERS = 11  # int64 (16,), zeroed before the threads start (llama/sync.mojo)
comptime S_CONTEXT = 12  # the largest position + 1 of any row
comptime S_SAMPLE_F = 13  # float64 (logit_rows, 3): temperature, top_p, uniform; 0 = return logits only
comptime S_SAMPLE_I = 14  # int64 (logit_rows, 2): top_k, greedy
comptime S_TOKENS_OUT = 15  # int64 (logit_rows,)
comptime S_LOGPROBS_OUT = 16  # float64 (logit_rows,)
comptime S_MIRRORS = 17  # how many mirrors: a row's keys and values also written into another cache
comptime S_MIRROR_ROW = 18  # int64 (mirrors,): the row
comptime S_MIRROR_KV = 19  # int64 (mirrors,): the other cache (same position)
comptime S_MIRROR_CAPACITY = 20  # int64 (mirrors,)

comptime ERR_TOKEN = 1
comptime ERR_POSITION = 2
comptime ERR_ROPE = 3
comptime ERR_WORKSPACE = 4
comptime ERR_THREAD = 5

# phases: 0 the embedding, then KINDS per layer, then the LM head, then sampling
comptime QKV = 0
comptime ATTENTION = 1
comptime OUT_PROJ = 2
comptime MLP_UP = 3
comptime MLP_DOWN = 4
comptime KINDS = 5
comptime COLS = 64  # matmul output columns per chunk
comptime VOCAB_COLS = 512  # LM head columns per chunk
comptime EMBED_ROWS = 16


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
    var mirrors: Int
    var mirror_row: I64Ptr
    var mirror_kv: I64Ptr
    var mirror_cap: I64Ptr

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
        self.mirrors = Int(self.tab[unsafe_offset=S_MIRRORS])
        self.mirror_row = I64Ptr(unsafe_from_address=Int(self.tab[unsafe_offset=S_MIRROR_ROW]))
        self.mirror_kv = I64Ptr(unsafe_from_address=Int(self.tab[unsafe_offset=S_MIRROR_KV]))
        self.mirror_cap = I64Ptr(unsafe_from_address=Int(self.tab[unsafe_offset=S_MIRROR_CAPACITY]))

    def p(self, r: Int) -> Int:
        return Int(self.pos[unsafe_offset=r])

    def cache(self, m: Model, r: Int, layer: Int, which: Int, g: Int) -> FPtr:
        """Position 0 of kv head g's keys (which=0) or values (1) in row r's cache.
        Cache layout: (layers, 2, kv_heads, capacity, head_dim) float32."""
        var cap = Int(self.cap[unsafe_offset=r])
        var base = Int(self.kv[unsafe_offset=r])
        return FPtr(unsafe_from_address=base + (((layer * 2 + which) * m.KVH + g) * cap) * m.D * 4)

    def mirror(self, m: Model, i: Int, layer: Int, which: Int, g: Int) -> FPtr:
        """Like ``cache`` for mirror i's cache."""
        var cap = Int(self.mirror_cap[unsafe_offset=i])
        var base = Int(self.mirror_kv[unsafe_offset=i])
        return FPtr(unsafe_from_address=base + (((layer * 2 + which) * m.KVH + g) * cap) * m.D * 4)


struct Work:
    """Workspace offsets (floats); mirrored by materl/engines/mojo_forward.py workspace_floats."""

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


def chunks_of(n: Int, size: Int) -> Int:
    return (n + size - 1) // size


struct Plan:
    """The phases of one forward pass and how many chunks each has."""

    var layers: Int
    var head: Int  # phase index of the LM head
    var phases: Int

    def __init__(out self, m: Model, s: Step):
        self.layers = m.layers
        self.head = 1 + KINDS * m.layers
        self.phases = self.head + (2 if s.tab[unsafe_offset=S_SAMPLE_F] != 0 else 1)

    def chunks(self, m: Model, s: Step, p: Int) -> Int:
        if p == 0:
            return chunks_of(s.M, EMBED_ROWS)
        if p == self.head:
            return chunks_of(m.V, VOCAB_COLS)
        if p > self.head:
            return s.R
        var kind = (p - 1) % KINDS
        if kind == QKV:
            return m.NH + 2 * m.KVH
        if kind == ATTENTION:
            return s.M * m.KVH
        if kind == MLP_UP:
            return chunks_of(m.I, COLS)
        return chunks_of(m.H, COLS)  # OUT_PROJ, MLP_DOWN


def check(m: Model, s: Step, w: Work, t: Int) -> Int:
    """Refuse bad input before any thread writes anything (every thread checks the same)."""
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
    for i in range(s.mirrors):
        var r = Int(s.mirror_row[unsafe_offset=i])
        if r < 0 or r >= s.M or s.p(r) >= Int(s.mirror_cap[unsafe_offset=i]):
            return ERR_POSITION
    return 0


def embed_chunk(m: Model, s: Step, w: Work, c: Int):
    var embed = m.at(M_EMBED)
    for r in range(c * EMBED_ROWS, min((c + 1) * EMBED_ROWS, s.M)):
        var src = embed.unsafe_offset(Int(s.tokens[unsafe_offset=r]) * m.H)
        var dst = w.x.unsafe_offset(r * m.H)
        for k in range(m.H):
            dst[unsafe_offset=k] = src[unsafe_offset=k]


def qkv_chunk(m: Model, s: Step, w: Work, layer: Int, u: Int):
    """Head unit u of the q, k, v projections (u < NH: q head u; then the kv heads' keys, then
    their values) for every row; RoPE on q and k; k and v written into the rows' caches."""
    var D = m.D
    var cos = m.at(M_COS)
    var sin = m.at(M_SIN)
    if u < m.NH:
        var y = w.q.unsafe_offset(u * D)
        gemm(w.xn, m.H, s.M, m.w(layer, Q_W), m.H, u * D, (u + 1) * D, y, m.NH * D, m.w(layer, Q_B),
             m.b(layer, Q_B), STORE)
        for r in range(s.M):
            var p = s.p(r)
            rope_head(y.unsafe_offset(r * m.NH * D), cos.unsafe_offset(p * D), sin.unsafe_offset(p * D), D)
        return
    var is_v = u >= m.NH + m.KVH
    var g = u - m.NH - (m.KVH if is_v else 0)
    var wi = V_W if is_v else K_W
    gemm(w.xn, m.H, s.M, m.w(layer, wi), m.H, g * D, (g + 1) * D, w.kvt, D, m.w(layer, wi + 1),
         m.b(layer, wi + 1), STORE)
    var which = 1 if is_v else 0
    for r in range(s.M):
        var p = s.p(r)
        var src = w.kvt.unsafe_offset(r * D)
        if not is_v:
            rope_head(src, cos.unsafe_offset(p * D), sin.unsafe_offset(p * D), D)
        copy_head(src, s.cache(m, r, layer, which, g).unsafe_offset(p * D), D)
    for i in range(s.mirrors):  # the same bits into the caches that share these positions
        var r = Int(s.mirror_row[unsafe_offset=i])
        copy_head(w.kvt.unsafe_offset(r * D), s.mirror(m, i, layer, which, g).unsafe_offset(s.p(r) * D), D)


@always_inline
def copy_head(src: FPtr, dst: FPtr, D: Int):
    for d in range(D):
        dst[unsafe_offset=d] = src[unsafe_offset=d]


def attention_chunk(m: Model, s: Step, w: Work, layer: Int, unit: Int, scale: Float32):
    """Attention of row unit // KVH for the query heads of kv head unit % KVH."""
    var G = m.NH // m.KVH
    var r = unit // m.KVH
    var g = unit % m.KVH
    var at = r * m.NH * m.D + g * G * m.D
    attend_group(w.q.unsafe_offset(at), w.attn.unsafe_offset(at), s.cache(m, r, layer, 0, g),
                 s.cache(m, r, layer, 1, g), s.p(r) + 1, G, m.D, scale, w.scores)


def mlp_up_chunk(m: Model, s: Step, w: Work, layer: Int, c: Int):
    """Columns of the gate and up projections, then silu(gate) * up in place."""
    var c0 = c * COLS
    var c1 = min(c0 + COLS, m.I)
    gemm(w.xn, m.H, s.M, m.w(layer, GATE_W), m.H, c0, c1, w.gate.unsafe_offset(c0), m.I, m.w(layer, GATE_B),
         m.b(layer, GATE_B), STORE)
    gemm(w.xn, m.H, s.M, m.w(layer, UP_W), m.H, c0, c1, w.up.unsafe_offset(c0), m.I, m.w(layer, UP_B),
         m.b(layer, UP_B), STORE)
    for r in range(s.M):
        silu_mul(w.gate.unsafe_offset(r * m.I + c0), w.up.unsafe_offset(r * m.I + c0), c1 - c0)


def residual_chunk(m: Model, s: Step, w: Work, layer: Int, c: Int, src: FPtr, K: Int, which: Int):
    """Columns of the residual update x += src @ W.T (+ b): attention output or MLP down."""
    var c0 = c * COLS
    var c1 = min(c0 + COLS, m.H)
    gemm(src, K, s.M, m.w(layer, which), K, c0, c1, w.x.unsafe_offset(c0), m.H, m.w(layer, which + 1),
         m.b(layer, which + 1), ACCUMULATE)


def head_chunk(m: Model, s: Step, w: Work, c: Int):
    var c0 = c * VOCAB_COLS
    var c1 = min(c0 + VOCAB_COLS, m.V)
    var logits = FPtr(unsafe_from_address=Int(s.tab[unsafe_offset=S_LOGITS]))
    gemm(w.xn, m.H, s.R, m.at(M_LM_HEAD), m.H, c0, c1, logits.unsafe_offset(c0), m.V, m.at(M_LM_BIAS),
         m.has(M_LM_BIAS), STORE)


def sample_chunk(m: Model, s: Step, w: Work, i: Int):
    """One token and its log-prob for logit row i (llama/sample.mojo)."""
    var pf = F64Ptr(unsafe_from_address=Int(s.tab[unsafe_offset=S_SAMPLE_F]))
    var pi = I64Ptr(unsafe_from_address=Int(s.tab[unsafe_offset=S_SAMPLE_I]))
    var logits = FPtr(unsafe_from_address=Int(s.tab[unsafe_offset=S_LOGITS]))
    var got = sample_row(logits.unsafe_offset(i * m.V), m.V, Float32(pf[unsafe_offset=3 * i]), Int(pi[unsafe_offset=2 * i]),
                         pf[unsafe_offset=3 * i + 1], pi[unsafe_offset=2 * i + 1] != 0, pf[unsafe_offset=3 * i + 2],
                         w.cv, w.ci)
    I64Ptr(unsafe_from_address=Int(s.tab[unsafe_offset=S_TOKENS_OUT]))[unsafe_offset=i] = Int64(got[0])
    F64Ptr(unsafe_from_address=Int(s.tab[unsafe_offset=S_LOGPROBS_OUT]))[unsafe_offset=i] = Float64(got[1])


def normalize(m: Model, s: Step, w: Work, plan: Plan, p: Int, eps: Float32):
    """This thread's xn for phase p: RMSNorm of x with the weight the phase's matmul follows
    (the LM head: only the rows that get logits)."""
    if p == plan.head:
        for i in range(s.R):
            var row = Int(s.logit_index[unsafe_offset=i])
            rmsnorm_row(w.x.unsafe_offset(row * m.H), w.xn.unsafe_offset(i * m.H), m.at(M_NORM), m.H, eps)
        return
    var layer = (p - 1) // KINDS
    var weight = m.w(layer, IN_NORM) if (p - 1) % KINDS == QKV else m.w(layer, POST_NORM)
    for r in range(s.M):
        rmsnorm_row(w.x.unsafe_offset(r * m.H), w.xn.unsafe_offset(r * m.H), weight, m.H, eps)


def run_chunk(m: Model, s: Step, w: Work, plan: Plan, p: Int, c: Int, scale: Float32):
    if p == 0:
        embed_chunk(m, s, w, c)
    elif p == plan.head:
        head_chunk(m, s, w, c)
    elif p > plan.head:
        sample_chunk(m, s, w, c)
    else:
        var layer = (p - 1) // KINDS
        var kind = (p - 1) % KINDS
        if kind == QKV:
            qkv_chunk(m, s, w, layer, c)
        elif kind == ATTENTION:
            attention_chunk(m, s, w, layer, c, scale)
        elif kind == OUT_PROJ:
            residual_chunk(m, s, w, layer, c, w.attn, m.NH * m.D, O_W)
        elif kind == MLP_UP:
            mlp_up_chunk(m, s, w, layer, c)
        else:
            residual_chunk(m, s, w, layer, c, w.gate, m.I, DOWN_W)


@always_inline
def needs_norm(plan: Plan, p: Int) -> Bool:
    if p == plan.head:
        return True
    if p == 0 or p > plan.head:
        return False
    var kind = (p - 1) % KINDS
    return kind == QKV or kind == MLP_UP


@export
def llama_forward(model_addr: Int, step_addr: Int, thread: Int, eps: Float64, scale: Float64) abi("C") -> Int:
    """Thread ``thread``'s part of one forward pass: it takes chunks until none are left. Every
    thread of the step must be called; all return once the pass (and sampling) is complete."""
    var m = Model(model_addr)
    var s = Step(step_addr)
    var w = Work(m, s, thread)
    var err = check(m, s, w, thread)
    if err != 0:
        return err
    var plan = Plan(m, s)
    var tickets = Tickets(Int(s.tab[unsafe_offset=S_COUNTERS]))
    var eps32 = Float32(eps)
    var scale32 = Float32(scale)
    var p = 0
    var first = 0  # first ticket of phase p
    var n = plan.chunks(m, s, 0)
    var normed = -1  # the phase this thread's xn was computed for
    while True:
        var i = tickets.take()
        while i >= first + n:
            first += n
            p += 1
            if p == plan.phases:
                return 0
            n = plan.chunks(m, s, p)
        tickets.wait_done(first)  # every chunk of the earlier phases
        if needs_norm(plan, p) and normed != p:
            normalize(m, s, w, plan, p, eps32)
            normed = p
        run_chunk(m, s, w, plan, p, i - first, scale32)
        tickets.finish()


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
