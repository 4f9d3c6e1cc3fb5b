"""Mojo kernels with torch fallbacks: reward kernels, the fused policy loss, group advantages,
fused reward chains and users' own kernels. Sources live in the top-level ``kernels/`` directory
(installed as ``materl.kernel_sources``) and are built on first use into a cache
(``materl.kernels.loader``).

    import materl.kernels as mk
    print(mk.status_table())     # which ops run in Mojo here, and why the others do not

Every kernel gives the same numbers as the torch op it stands for (``materl.ops``); the compiler
chooses which runs. ``MATERL_DISABLE_MOJO=1`` forces torch.
"""

from materl.kernels.advantages import group_advantages
from materl.kernels.fusion import RewardChain, UserKernel, fusable, load_user_kernel
from materl.kernels.loader import (
    Kernel,
    MojoFallbackWarning,
    cache_root,
    compile_file,
    compile_source,
    kernel_dir,
    load,
    status,
    status_table,
)
from materl.kernels.policy_loss import fused_policy_loss, policy_loss_torch
from materl.kernels.rewards import (
    diversity,
    length,
    length_stats,
    pad_ids,
    pattern_match,
    repetition,
)

__all__ = [
    "Kernel", "MojoFallbackWarning", "RewardChain", "UserKernel", "cache_root", "compile_file", "compile_source",
    "diversity", "fusable", "fused_policy_loss", "group_advantages", "kernel_dir", "length", "length_stats", "load",
    "load_user_kernel", "pad_ids", "pattern_match", "policy_loss_torch", "repetition", "status", "status_table",
]
