# Example user kernel for @ml.mojo_op: a repetition penalty per completion.
#
#     @ml.mojo_op(path="kernels/repetition_penalty.mojo")
#     def repetition_penalty(completions: torch.Tensor) -> {"penalty_scores": torch.Tensor}: ...
#
# materl loads it with materl.kernels.fusion.load_user_kernel(path, "repetition_penalty",
# ["penalty_scores"]) and calls it once per batch. The calling convention every user kernel
# follows (details in materl/kernels/fusion.py):
#
#   @export
#   def NAME(<inputs>, <outputs>, B: Int, T: Int) abi("C") -> Int
#
#   <inputs>   one argument per Python argument, in order: a tensor arrives as the Int address of
#              its contiguous data (int64 for integer tensors, float64 for real ones); B lists of
#              token ids (completions) arrive as TWO addresses: ids (B, T) int64 padded, then
#              lengths (B,) int64; a Python int as Int, a float as Float64.
#   <outputs>  the Int address of each declared output, float64, zero-filled, (B,) unless declared
#              "B,T".
#   B, T       rows and columns of the first tensor input (T = 1 for a (B,) tensor).
#   result     0 on success; any other value raises KernelError naming the code.


comptime I64Ptr = Pointer[Int64, MutUntrackedOrigin]
comptime F64Ptr = Pointer[Float64, MutUntrackedOrigin]


@export
def repetition_penalty(ids_addr: Int, lens_addr: Int, out_addr: Int, B: Int, T: Int) abi("C") -> Int:
    """Set out[b] = (tokens equal to the token before them) / (L - 1), 0 when L < 2.

    A completion stuck on one token ("the the the") scores near 1; subtract it from a reward.
    """
    var ids = I64Ptr(unsafe_from_address=ids_addr)
    var lens = I64Ptr(unsafe_from_address=lens_addr)
    var out = F64Ptr(unsafe_from_address=out_addr)
    for b in range(B):
        var L = Int(lens[unsafe_offset=b])
        if L < 0 or L > T:
            return -1
        var repeats = 0
        for t in range(1, L):
            if ids[unsafe_offset=b * T + t] == ids[unsafe_offset=b * T + t - 1]:
                repeats += 1
        out[unsafe_offset=b] = Float64(repeats) / Float64(L - 1) if L > 1 else 0.0
    return 0
