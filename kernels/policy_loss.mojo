# Fused policy loss: per-token loss (ppo_clip | gspo | cispo), optionally weighted per token (an
# off-policy correction's w), x aggregation x optional KL term (optionally clamped, optionally
# times the importance ratio pi/pi_old: TRL's bias-corrected KL), its metrics, and d loss / d logp
# -- each in one sweep over the (B, T) inputs, with no intermediate (B, T) buffers (the backward
# writes only the gradient).
#
# Reference semantics (value AND gradient, torch autograd conventions at ties and clamp edges):
# materl/ops/losses.py, materl/ops/aggregate.py, materl/ops/kl.py (kl_penalty, bias_corrected_kl),
# materl/ops/offpolicy.py (the weights); the Python wrapper is
# materl/kernels/policy_loss.py. Arithmetic is float64 whatever the input dtype.
#
# Calling convention (materl/kernels/loader.py): @export ... abi("C") -> Int; 0 = success.

from std.math import exp

comptime PPO_CLIP = 0
comptime GSPO = 1
comptime CISPO = 2

comptime TOKEN_MEAN = 0
comptime TOKEN_SUM = 1
comptime SEQ_MEAN_TOKEN_SUM = 2
comptime SEQ_MEAN_TOKEN_MEAN = 3
comptime SEQ_MEAN_TOKEN_SUM_NORM = 4

comptime KL_NONE = 0
comptime K1 = 1
comptime K2 = 2
comptime K3 = 3
comptime KL_ABS = 4
comptime K3_PLUS = 5

comptime LOG_RATIO_BOUND = 20.0
comptime GSPO_LOG_MAX = 10.0

# forward results, in this order, in the caller's float64 out buffer
comptime N_OUT = 11  # loss, pg, kl_agg, clipfrac, clipfrac_lower, ppo_kl, ratio, kl_mean, tokens, seqs, denom


struct Hyper:
    var loss: Int
    var agg: Int
    var kl: Int
    var one_sided: Bool
    var kl_ratio: Bool  # the KL term times r = exp(clamp(logp - old, -20, 20)), with its gradient
    var eps_low: Float64
    var eps_high: Float64
    var dual: Float64  # <= 0: no dual clip
    var kl_clamp: Float64  # <= 0: no clamp
    var kl_coef: Float64
    var denom: Float64  # < 0: computed from the mask
    var norm: Float64

    def __init__(out self, loss: Int, agg: Int, kl: Int, one_sided: Int, kl_ratio: Int, eps_low: Float64,
                 eps_high: Float64, dual: Float64, kl_clamp: Float64, kl_coef: Float64, denom: Float64, norm: Float64):
        self.loss = loss
        self.agg = agg
        self.kl = kl
        self.one_sided = one_sided != 0
        self.kl_ratio = kl_ratio != 0
        self.eps_low = eps_low
        self.eps_high = eps_high
        self.dual = dual
        self.kl_clamp = kl_clamp
        self.kl_coef = kl_coef
        self.denom = denom
        self.norm = norm


struct Tok:
    """One token's loss value, d value / d logp, and stats."""

    var value: Float64
    var grad: Float64
    var ratio: Float64
    var clip: Float64
    var lower: Float64

    def __init__(out self):
        self.value = 0.0
        self.grad = 0.0
        self.ratio = 0.0
        self.clip = 0.0
        self.lower = 0.0


@always_inline
def inside(x: Float64, lo: Float64, hi: Float64) -> Float64:
    """1 where torch.clamp passes the gradient (lo <= x <= hi), else 0."""
    return 1.0 if (x >= lo and x <= hi) else 0.0


@always_inline
def clamp(x: Float64, lo: Float64, hi: Float64) -> Float64:
    return lo if x < lo else (hi if x > hi else x)


@always_inline
def clipped_surrogate(mut t: Tok, a: Float64, r: Float64, dr: Float64, h: Hyper):
    """Value and gradient of max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) (torch.maximum splits a tie)."""
    var lo = 1.0 - h.eps_low
    var hi = 1.0 + h.eps_high
    var u = -a * r
    var du = -a * dr
    var c = -a * clamp(r, lo, hi)
    var dc = -a * dr * inside(r, lo, hi)
    if u > c:
        t.value = u
        t.grad = du
    elif c > u:
        t.value = c
        t.grad = dc
    else:
        t.value = u
        t.grad = 0.5 * (du + dc)
    t.clip = 1.0 if c > u else 0.0
    t.ratio = r


@always_inline
def token_loss(mut t: Tok, lp: Float64, old: Float64, a: Float64, r: Float64, seq_log: Float64, h: Hyper):
    """One token's loss; r = exp(clamp(lp - old, -20, 20)) (ppo_clip, cispo) or the row's GSPO ratio."""
    if h.loss == GSPO:  # r = exp(min(seq_log, 10)); the clamp passes the gradient while seq_log <= 10
        clipped_surrogate(t, a, r, r * (1.0 if seq_log <= GSPO_LOG_MAX else 0.0), h)
        return
    if h.loss == CISPO:
        var w: Float64
        if h.one_sided:
            w = r if r < 1.0 + h.eps_high else 1.0 + h.eps_high
        else:
            w = clamp(r, 1.0 - h.eps_low, 1.0 + h.eps_high)
        var wa = -w * a
        t.value = wa * lp
        t.grad = wa
        t.ratio = r
        t.clip = 1.0 if w != r else 0.0
        return
    clipped_surrogate(t, a, r, r * inside(lp - old, -LOG_RATIO_BOUND, LOG_RATIO_BOUND), h)
    t.lower = 0.0
    if h.dual > 0.0 and a < 0.0:
        var bound = -a * h.dual
        if t.value > bound:
            t.lower = 1.0
            t.value = bound
            t.grad = 0.0
        elif t.value == bound:
            t.grad = 0.5 * t.grad


@always_inline
def kl_token(mut t: Tok, lp: Float64, rf: Float64, ex: Float64, old: Float64, r: Float64, h: Hyper):
    """Value and gradient of the KL estimator (materl.ops.kl) at one token; ex = exp(clamp(rf - lp, -20, 20)),
    r = exp(clamp(lp - old, -20, 20)) (read only with kl_ratio)."""
    var d = lp - rf
    var v: Float64
    var g: Float64
    if h.kl == K1:
        v = d
        g = 1.0
    elif h.kl == K2:
        v = 0.5 * (d * d)
        g = d
    elif h.kl == KL_ABS:
        v = d if d >= 0.0 else -d
        g = 1.0 if d > 0.0 else (-1.0 if d < 0.0 else 0.0)
    else:  # K3, K3_PLUS: exp(x) - x - 1, x = clamp(ref - logp, -20, 20)
        var xr = rf - lp
        var x = clamp(xr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        v = ex - x - 1.0
        g = -(ex - 1.0) * inside(xr, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if h.kl_clamp > 0.0:
        g = g * inside(v, -h.kl_clamp, h.kl_clamp)
        v = clamp(v, -h.kl_clamp, h.kl_clamp)
    if h.kl == K3_PLUS:
        g = d  # straight-through: the gradient of k2
    if h.kl_ratio:  # d (r v) / d lp = r (g + v), r's gradient passing inside the [-20, 20] bound
        g = r * (g + v * inside(lp - old, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        v = r * v
    t.value = v
    t.grad = g


comptime W = 8  # tokens per SIMD exp
comptime Vec = SIMD[DType.float64, W]


struct Inputs[dt: DType]:
    var logp: Pointer[Scalar[Self.dt], MutUntrackedOrigin]
    var old: Pointer[Scalar[Self.dt], MutUntrackedOrigin]
    var ref_lp: Pointer[Scalar[Self.dt], MutUntrackedOrigin]
    var adv: Pointer[Scalar[Self.dt], MutUntrackedOrigin]
    var mask: Pointer[Scalar[Self.dt], MutUntrackedOrigin]
    var wt: Pointer[Scalar[Self.dt], MutUntrackedOrigin]  # per-token loss weights; read only if has_wt
    var has_wt: Bool
    var adv_sb: Int
    var adv_st: Int
    var T: Int

    def __init__(out self, logp: Int, old: Int, ref_lp: Int, adv: Int, mask: Int, wt: Int, adv_sb: Int, adv_st: Int,
                 T: Int):
        self.logp = Pointer[Scalar[Self.dt], MutUntrackedOrigin](unsafe_from_address=logp)
        self.old = Pointer[Scalar[Self.dt], MutUntrackedOrigin](unsafe_from_address=old)
        self.ref_lp = Pointer[Scalar[Self.dt], MutUntrackedOrigin](unsafe_from_address=ref_lp)
        self.adv = Pointer[Scalar[Self.dt], MutUntrackedOrigin](unsafe_from_address=adv)
        self.mask = Pointer[Scalar[Self.dt], MutUntrackedOrigin](unsafe_from_address=mask)
        self.wt = Pointer[Scalar[Self.dt], MutUntrackedOrigin](unsafe_from_address=wt)
        self.has_wt = wt != 0
        self.adv_sb = adv_sb
        self.adv_st = adv_st
        self.T = T

    @always_inline
    def get(self, p: Pointer[Scalar[Self.dt], MutUntrackedOrigin], i: Int) -> Float64:
        return p[unsafe_offset=i].cast[DType.float64]()

    @always_inline
    def weight(self, i: Int) -> Float64:
        return self.get(self.wt, i) if self.has_wt else 1.0

    def row_stats(self, b: Int, loss: Int) -> Tuple[Float64, Float64]:
        """(sum_t mask, GSPO's sequence log-ratio sum_t m (logp - old) / max(sum m, 1))."""
        var count: Float64 = 0.0
        var log_sum: Float64 = 0.0
        for t in range(self.T):
            var i = b * self.T + t
            var m = self.get(self.mask, i)
            count += m
            if loss == GSPO and m != 0.0:
                log_sum += (self.get(self.logp, i) - self.get(self.old, i)) * m
        var seq_log = log_sum / (count if count > 1.0 else 1.0)
        return (count, seq_log)

    @always_inline
    def exps(self, i0: Int, k: Int, need_r: Bool, need_ex: Bool) -> Tuple[Vec, Vec]:
        """For tokens i0..i0+k-1 (k <= W): exp(clamp(logp - old)) and exp(clamp(ref - logp)), lane-wise."""
        var dr = Vec(0)
        var dx = Vec(0)
        for l in range(k):
            var lp = self.get(self.logp, i0 + l)
            if need_r:
                dr[l] = clamp(lp - self.get(self.old, i0 + l), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
            if need_ex:
                dx[l] = clamp(self.get(self.ref_lp, i0 + l) - lp, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return (exp(dr) if need_r else dr, exp(dx) if need_ex else dx)


def gspo_ratio(seq_log: Float64) -> Float64:
    return exp(seq_log if seq_log < GSPO_LOG_MAX else GSPO_LOG_MAX)


def agg_denominator(agg: Int, tokens: Float64, seqs: Float64, denom: Float64) -> Float64:
    """The normaliser D of the aggregation (aggregate.py): tokens, 1 or rows with a token; or ``denom``."""
    if denom >= 0.0:
        return denom
    if agg == TOKEN_MEAN:
        return tokens
    if agg == TOKEN_SUM:
        return 1.0
    return seqs


struct Sums:
    var pg: Float64  # sum of row terms (row-normalised for seq_mean_token_mean)
    var kl: Float64
    var tokens: Float64
    var seqs: Float64
    var clip: Float64
    var lower: Float64
    var ppo_kl: Float64
    var ratio: Float64
    var kl_mean: Float64

    def __init__(out self):
        self.pg = 0.0
        self.kl = 0.0
        self.tokens = 0.0
        self.seqs = 0.0
        self.clip = 0.0
        self.lower = 0.0
        self.ppo_kl = 0.0
        self.ratio = 0.0
        self.kl_mean = 0.0


def forward_row[dt: DType](x: Inputs[dt], b: Int, h: Hyper, mut acc: Sums):
    var has_ref = h.kl != KL_NONE
    var need_ex = h.kl == K3 or h.kl == K3_PLUS
    var seq_log: Float64 = 0.0
    var s: Float64 = 0.0
    if h.loss == GSPO:
        seq_log = x.row_stats(b, h.loss)[1]
        s = gspo_ratio(seq_log)
    var row_pg: Float64 = 0.0
    var row_kl: Float64 = 0.0
    var count: Float64 = 0.0
    var t = Tok()
    var k = Tok()
    var j0 = 0
    while j0 < x.T:
        var n = W if j0 + W <= x.T else x.T - j0
        var i0 = b * x.T + j0
        var e = x.exps(i0, n, h.loss != GSPO or h.kl_ratio, need_ex)
        for l in range(n):
            var i = i0 + l
            var m = x.get(x.mask, i)
            count += m
            if m == 0.0:
                continue
            var lp = x.get(x.logp, i)
            var old = x.get(x.old, i)
            var r = s if h.loss == GSPO else e[0][l]
            token_loss(t, lp, old, x.get(x.adv, b * x.adv_sb + (j0 + l) * x.adv_st), r, seq_log, h)
            row_pg += t.value * m * x.weight(i)
            acc.clip += t.clip * m
            acc.lower += t.lower * m
            acc.ppo_kl += (old - lp) * m
            acc.ratio += t.ratio * m
            if has_ref:
                kl_token(k, lp, x.get(x.ref_lp, i), e[1][l], old, e[0][l], h)
                row_kl += k.value * m
                acc.kl_mean += k.value * m
        j0 += W
    acc.tokens += count
    if count > 0.0:
        acc.seqs += 1.0
    if h.agg == SEQ_MEAN_TOKEN_MEAN and count > 0.0:
        row_pg /= count
        row_kl /= count
    acc.pg += row_pg
    acc.kl += row_kl


def forward[dt: DType](x: Inputs[dt], B: Int, h: Hyper, out_addr: Int):
    var out = Pointer[Float64, MutUntrackedOrigin](unsafe_from_address=out_addr)
    var acc = Sums()
    for b in range(B):
        forward_row[dt](x, b, h, acc)
    var D = agg_denominator(h.agg, acc.tokens, acc.seqs, h.denom)
    var pg = (acc.pg / D if D > 0.0 else 0.0)
    var kl_agg = (acc.kl / D if D > 0.0 else 0.0)
    if h.agg == SEQ_MEAN_TOKEN_SUM_NORM:
        pg = pg / h.norm
        kl_agg = kl_agg / h.norm
    var n_mean = acc.tokens if acc.tokens > 1.0 else 1.0
    out[unsafe_offset=0] = pg + h.kl_coef * kl_agg if (h.kl != KL_NONE and h.kl_coef != 0.0) else pg
    out[unsafe_offset=1] = pg
    out[unsafe_offset=2] = kl_agg
    out[unsafe_offset=3] = acc.clip / n_mean
    out[unsafe_offset=4] = acc.lower / n_mean
    out[unsafe_offset=5] = acc.ppo_kl / n_mean
    out[unsafe_offset=6] = acc.ratio / n_mean
    out[unsafe_offset=7] = acc.kl_mean / n_mean
    out[unsafe_offset=8] = acc.tokens
    out[unsafe_offset=9] = acc.seqs
    out[unsafe_offset=10] = D


def backward[dt: DType](x: Inputs[dt], B: Int, h: Hyper, g_out: Float64, D: Float64, grad_addr: Int):
    """Set grad[b, t] = g_out * m * w_b * (d loss_t + kl_coef * d kl_t); w_b = 1/D (1/(D norm), 1/(D n_b))."""
    var grad = Pointer[Scalar[dt], MutUntrackedOrigin](unsafe_from_address=grad_addr)
    var has_ref = h.kl != KL_NONE and h.kl_coef != 0.0
    var need_ex = has_ref and (h.kl == K3 or h.kl == K3_PLUS)
    var base: Float64 = 0.0
    if D > 0.0:
        base = g_out / D
        if h.agg == SEQ_MEAN_TOKEN_SUM_NORM:
            base = base / h.norm
    var t = Tok()
    var k = Tok()
    for b in range(B):
        var w = base
        var seq_log: Float64 = 0.0
        var s: Float64 = 0.0
        if h.loss == GSPO or h.agg == SEQ_MEAN_TOKEN_MEAN:
            var st = x.row_stats(b, h.loss)
            seq_log = st[1]
            s = gspo_ratio(seq_log) if h.loss == GSPO else 0.0
            if h.agg == SEQ_MEAN_TOKEN_MEAN and st[0] > 0.0:
                w = base / st[0]
        var j0 = 0
        while j0 < x.T:
            var n = W if j0 + W <= x.T else x.T - j0
            var i0 = b * x.T + j0
            var need_r = h.loss != GSPO or (has_ref and h.kl_ratio)
            var e = x.exps(i0, n, need_r and w != 0.0, need_ex and w != 0.0)
            for l in range(n):
                var i = i0 + l
                var m = x.get(x.mask, i)
                if m == 0.0 or w == 0.0:
                    grad[unsafe_offset=i] = Scalar[dt](0)
                    continue
                var lp = x.get(x.logp, i)
                var old = x.get(x.old, i)
                var r = s if h.loss == GSPO else e[0][l]
                token_loss(t, lp, old, x.get(x.adv, b * x.adv_sb + (j0 + l) * x.adv_st), r, seq_log, h)
                var gsum = t.grad * x.weight(i)
                if has_ref:
                    kl_token(k, lp, x.get(x.ref_lp, i), e[1][l], old, e[0][l], h)
                    gsum += h.kl_coef * k.grad
                grad[unsafe_offset=i] = (w * m * gsum).cast[dt]()
            j0 += W


@export
def policy_loss_fwd_f64(logp: Int, old: Int, ref_lp: Int, adv: Int, mask: Int, wt: Int, B: Int, T: Int,
                        adv_sb: Int, adv_st: Int, loss: Int, agg: Int, kl: Int, one_sided: Int, kl_ratio: Int,
                        eps_low: Float64, eps_high: Float64, dual: Float64, kl_clamp: Float64, kl_coef: Float64,
                        denom: Float64, norm: Float64, out_addr: Int) abi("C") -> Int:
    """Forward on float64 inputs; writes the N_OUT results to out_addr."""
    var h = Hyper(loss, agg, kl, one_sided, kl_ratio, eps_low, eps_high, dual, kl_clamp, kl_coef, denom, norm)
    forward[DType.float64](Inputs[DType.float64](logp, old, ref_lp, adv, mask, wt, adv_sb, adv_st, T), B, h,
                           out_addr)
    return 0


@export
def policy_loss_fwd_f32(logp: Int, old: Int, ref_lp: Int, adv: Int, mask: Int, wt: Int, B: Int, T: Int,
                        adv_sb: Int, adv_st: Int, loss: Int, agg: Int, kl: Int, one_sided: Int, kl_ratio: Int,
                        eps_low: Float64, eps_high: Float64, dual: Float64, kl_clamp: Float64, kl_coef: Float64,
                        denom: Float64, norm: Float64, out_addr: Int) abi("C") -> Int:
    """Forward on float32 inputs (float64 arithmetic); writes the N_OUT results to out_addr."""
    var h = Hyper(loss, agg, kl, one_sided, kl_ratio, eps_low, eps_high, dual, kl_clamp, kl_coef, denom, norm)
    forward[DType.float32](Inputs[DType.float32](logp, old, ref_lp, adv, mask, wt, adv_sb, adv_st, T), B, h,
                           out_addr)
    return 0


@export
def policy_loss_bwd_f64(logp: Int, old: Int, ref_lp: Int, adv: Int, mask: Int, wt: Int, B: Int, T: Int,
                        adv_sb: Int, adv_st: Int, loss: Int, agg: Int, kl: Int, one_sided: Int, kl_ratio: Int,
                        eps_low: Float64, eps_high: Float64, dual: Float64, kl_clamp: Float64, kl_coef: Float64,
                        denom: Float64, norm: Float64, g_out: Float64, D: Float64, grad_addr: Int) abi("C") -> Int:
    """Backward on float64 inputs: writes d loss / d logp (B, T) to grad_addr."""
    var h = Hyper(loss, agg, kl, one_sided, kl_ratio, eps_low, eps_high, dual, kl_clamp, kl_coef, denom, norm)
    backward[DType.float64](Inputs[DType.float64](logp, old, ref_lp, adv, mask, wt, adv_sb, adv_st, T), B, h, g_out, D,
                            grad_addr)
    return 0


@export
def policy_loss_bwd_f32(logp: Int, old: Int, ref_lp: Int, adv: Int, mask: Int, wt: Int, B: Int, T: Int,
                        adv_sb: Int, adv_st: Int, loss: Int, agg: Int, kl: Int, one_sided: Int, kl_ratio: Int,
                        eps_low: Float64, eps_high: Float64, dual: Float64, kl_clamp: Float64, kl_coef: Float64,
                        denom: Float64, norm: Float64, g_out: Float64, D: Float64, grad_addr: Int) abi("C") -> Int:
    """Backward on float32 inputs: writes d loss / d logp (B, T) to grad_addr."""
    var h = Hyper(loss, agg, kl, one_sided, kl_ratio, eps_low, eps_high, dual, kl_clamp, kl_coef, denom, norm)
    backward[DType.float32](Inputs[DType.float32](logp, old, ref_lp, adv, mask, wt, adv_sb, adv_st, T), B, h, g_out, D,
                            grad_addr)
    return 0
