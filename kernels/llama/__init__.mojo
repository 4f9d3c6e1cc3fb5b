# The Llama-family forward pass of materl's Mojo generation engine (kernels/llama_engine.mojo):
# gemm.mojo (x @ W.T with a fixed per-element reduction order), layers.mojo (RMSNorm, RoPE,
# grouped-query attention over a per-request KV cache, SwiGLU), sample.mojo (temperature,
# top-k, top-p, greedy; log-probs), sync.mojo (how the engine's threads share a pass).
#
# What Mojo 1.2.0 lacks here, and what is used instead:
# - No parallel loop (std.algorithm has vectorize, no parallelize): Python threads call the same
#   exported function with their index (ctypes releases the GIL) and share the work through
#   Atomic[Int64] counters (std.atomic: fetch_add, load[ordering=Ordering.ACQUIRE]); waiting
#   spins with the x86 pause hint (std.sys.llvm_intrinsic) and calls sched_yield through
#   std.ffi.external_call.
# - InlineArray is neither in the prelude nor in std.collections: register tiles are
#   std.utils.StaticTuple[SIMD[...], n] indexed by `comptime for` loop variables, which LLVM
#   keeps in registers.
# Also (deprecations, not gaps): UnsafePointer and its load/store give way to
# Pointer[T, MutUntrackedOrigin] with unsafe_load[width=8] / unsafe_store / [unsafe_offset=i];
# `@parameter for/if` to `comptime for/if`. sample.mojo sorts (value, token id) pairs held in two
# scratch buffers with its own heap sort (a total order, ties by token id).
