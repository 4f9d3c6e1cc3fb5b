# The per-row pieces of a Llama-family layer, float32, written to match HF transformers'
# LlamaRMSNorm, apply_rotary_pos_emb, eager attention and SwiGLU MLP up to summation order.
# Each function works on one row (one token), so its result never depends on other rows.

from std.math import exp, sqrt

comptime L = 8
comptime V8 = SIMD[DType.float32, L]
comptime FPtr = Pointer[Float32, MutUntrackedOrigin]


def rmsnorm_row(src: FPtr, dst: FPtr, weight: FPtr, H: Int, eps: Float32):
    """dst = weight * (src * rsqrt(mean(src^2) + eps))   (HF LlamaRMSNorm, float32)."""
    var acc = V8(0)
    for k in range(0, H, L):
        var v = src.unsafe_load[width=L](k)
        acc = v.fma(v, acc)
    var scale = Float32(1) / sqrt(acc.reduce_add() / Float32(H) + eps)
    for k in range(0, H, L):
        dst.unsafe_store(k, weight.unsafe_load[width=L](k) * (src.unsafe_load[width=L](k) * scale))


def rope_head(v: FPtr, cos: FPtr, sin: FPtr, D: Int):
    """In place: v * cos + rotate_half(v) * sin, rotate_half(v) = cat(-v[D/2:], v[:D/2]) (HF)."""
    var half = D // 2
    for i in range(half):
        var a = v[unsafe_offset=i]
        var b = v[unsafe_offset=i + half]
        v[unsafe_offset=i] = a * cos[unsafe_offset=i] - b * sin[unsafe_offset=i]
        v[unsafe_offset=i + half] = b * cos[unsafe_offset=i + half] + a * sin[unsafe_offset=i + half]


@always_inline
def dot(a: FPtr, b: FPtr, D: Int) -> Float32:
    var acc = V8(0)
    for k in range(0, D, L):
        acc = a.unsafe_load[width=L](k).fma(b.unsafe_load[width=L](k), acc)
    return acc.reduce_add()


def attend_group(q: FPtr, dst: FPtr, keys: FPtr, values: FPtr, n_pos: Int, G: Int, D: Int, scale: Float32,
                 scores: FPtr):
    """Attention of the G query heads that share one key/value head, for one row.

    q and dst: the G heads' vectors, consecutive (G * D floats); keys/values: positions
    0..n_pos-1 of the shared head (n_pos * D floats each). For each head i:
    s_j = (q_i . k_j) * scale, p = softmax(s), dst_i = sum_j p_j v_j, computed as
    (sum_j e_j v_j) / sum_j e_j with e_j = exp(s_j - max s). Keys and values are read once for
    all G heads (the cache of a long row does not fit in cache; reading it G times costs G times
    the memory traffic). ``scores`` holds G * (n_pos + 1) floats: head i's weights at
    i * (n_pos + 1) + j, their sum after them.
    """
    var stride = n_pos + 1
    for j in range(n_pos):
        var kj = keys.unsafe_offset(j * D)
        for i in range(G):
            scores[unsafe_offset=i * stride + j] = dot(q.unsafe_offset(i * D), kj, D) * scale
    for i in range(G):
        var s = scores.unsafe_offset(i * stride)
        var mx = s[unsafe_offset=0]
        for j in range(1, n_pos):
            mx = max(mx, s[unsafe_offset=j])
        var total = Float32(0)
        for j in range(n_pos):
            var e = exp(s[unsafe_offset=j] - mx)
            s[unsafe_offset=j] = e
            total += e
        s[unsafe_offset=n_pos] = total
        for d in range(0, D, L):
            dst.unsafe_store(i * D + d, V8(0))
    for j in range(n_pos):
        var vj = values.unsafe_offset(j * D)
        for i in range(G):
            var e = V8(scores[unsafe_offset=i * stride + j])
            var o = dst.unsafe_offset(i * D)
            for d in range(0, D, L):
                o.unsafe_store(d, vj.unsafe_load[width=L](d).fma(e, o.unsafe_load[width=L](d)))
    for i in range(G):
        var total = V8(scores[unsafe_offset=i * stride + n_pos])
        var o = dst.unsafe_offset(i * D)
        for d in range(0, D, L):
            o.unsafe_store(d, o.unsafe_load[width=L](d) / total)


def silu_mul(gate: FPtr, up: FPtr, n: Int):
    """In place: gate = silu(gate) * up, silu(g) = g / (1 + exp(-g))."""
    for k in range(n):
        var g = gate[unsafe_offset=k]
        gate[unsafe_offset=k] = g / (Float32(1) + exp(-g)) * up[unsafe_offset=k]
