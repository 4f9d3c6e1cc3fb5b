# The Llama-family forward pass of materl's Mojo generation engine (kernels/llama_engine.mojo):
# gemm.mojo (x @ W.T with a fixed per-element reduction order), layers.mojo (RMSNorm, RoPE,
# grouped-query attention over a per-request KV cache, SwiGLU), sync.mojo (the barrier the
# engine's threads meet at between phases).
