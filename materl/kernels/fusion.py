"""Kernel fusion of reward chains, and users' own Mojo kernels (``@ml.mojo_op``).

Reward chains
-------------
    chain = RewardChain([("repetition", {"n": 3}, 0.5), ("diversity", {}, 0.3),
                         ("length", {"target": 64}, 0.2)])
    total_B, parts = chain(ids_B_T, lengths_B)      # ONE kernel call per batch
    print(chain.source())                           # the generated Mojo module

The built-in reward kernels (``kernels/rewards.mojo``) are streaming accumulators, so a chain of
them over the same completions compiles into ONE generated kernel that reads each row once and
steps every accumulator on every token (n-gram counters with the same n are shared). The module
is ``rewards.mojo`` plus the generated ``reward_chain`` entry point; it is built once and cached
by the hash of its source (``loader.compile_source``). The source depends only on the chain's
structure (which rewards, which share a counter): weights, n, targets and patterns travel in
parameter buffers, so re-weighting a chain does not rebuild it. ``total`` and each part equal the
separate calls bit for bit: parts are the same integer-count ratios; ``total`` is
``((w_0 r_0 + w_1 r_1) + ...)`` in float64, as ``chain.separate`` computes it (kernels are built
without FMA contraction).

User kernels (calling convention)
---------------------------------
``load_user_kernel(path, fn_name, outputs)`` builds the user's .mojo file (cached like the
built-ins; a missing file or a compile error raises ``KernelError`` carrying the compiler's
message) and returns a callable ``kernel(*inputs) -> {output name: tensor}``. The Mojo function::

    @export
    def NAME(<inputs>, <outputs>, B: Int, T: Int) abi("C") -> Int

- ``<inputs>``: one argument per Python argument, in order. A tensor arrives as the ``Int``
  address of its contiguous data (converted to int64 if integer/bool, float64 if real); B lists
  of token ids (completions) arrive as TWO addresses, ids (B, T) int64 zero-padded then lengths
  (B,) int64; a Python int as ``Int``, a float as ``Float64``.
- ``<outputs>``: the ``Int`` address of each declared output, float64, zero-filled, shape (B,),
  or (B, T) when declared ``{"name": "B,T"}``.
- ``B, T``: rows and columns of the first tensor input (T = 1 for a (B,) tensor).
- result: 0 on success; anything else raises ``KernelError`` with the code.

Read an address with ``Pointer[Int64, MutUntrackedOrigin](unsafe_from_address=addr)`` and index
it with ``p[unsafe_offset=i]``; ``kernels/repetition_penalty.mojo`` is a complete example (the
``@ml.mojo_op(path="kernels/repetition_penalty.mojo")``). User kernels are built as their
own module; fusing them into a reward chain is not supported (a whole-batch function cannot be
interleaved per token).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from materl.errors import ConfigError, KernelError
from materl.kernels import loader
from materl.kernels import rewards as R

#: Reward kinds a chain can fuse, with the parameters each accepts.
FUSABLE = {"repetition": ("n",), "diversity": ("n",), "length": ("target", "range", "scale"),
           "pattern_match": ("pattern",)}
_DEFAULT_N = {"repetition": 3, "diversity": 1}


def fusable(name: str, params: Mapping) -> bool:
    """Whether reward ``name`` with ``params`` can join a fused chain."""
    return name in FUSABLE and set(params) <= set(FUSABLE[name])


@dataclass(frozen=True)
class _Term:
    kind: str
    params: dict
    weight: float
    acc: int | None  # accumulator index (None: length, computed from L alone)


class RewardChain:
    """Several reward kernels over the same completions, weighted and summed, in one kernel call."""

    def __init__(self, terms: Sequence[tuple[str, Mapping, float]]):
        if not terms:
            raise ConfigError("a reward chain needs at least one (name, params, weight) term, got none")
        self._accs: list[tuple[str, int]] = []  # ("ngram", n) or ("pattern", term index)
        built = []
        for k, (kind, params, weight) in enumerate(terms):
            params = dict(params)
            if not fusable(kind, params):
                allowed = (f"{kind} takes {', '.join(FUSABLE[kind])}" if kind in FUSABLE
                           else f"fusable: {', '.join(FUSABLE)}")
                raise ConfigError(
                    f"reward chain term {k}: cannot fuse {kind!r} with params {sorted(params)} ({allowed})")
            built.append(_Term(kind, self._normalise(kind, params), float(weight), self._acc_for(kind, params, k)))
        self.terms = tuple(built)
        self.labels = _labels([t.kind for t in self.terms])
        self._source: str | None = None

    @staticmethod
    def _normalise(kind: str, params: dict) -> dict:
        if kind in _DEFAULT_N:
            return {"n": R._check_n(kind, params.get("n", _DEFAULT_N[kind]))}
        if kind == "length":
            lo, hi, scale = R.length_interval(**params)
            return {"lo": lo, "hi": hi, "scale": scale}
        return {"pattern": R.as_pattern(params["pattern"]) if "pattern" in params else R.as_pattern([])}

    def _acc_for(self, kind: str, params: dict, k: int) -> int | None:
        if kind == "length":
            return None
        key = ("ngram", params.get("n", _DEFAULT_N[kind])) if kind in _DEFAULT_N else ("pattern", k)
        if key not in self._accs:
            self._accs.append(key)
        return self._accs.index(key)

    def __repr__(self) -> str:
        inner = " + ".join(f"{t.weight:g} * {t.kind}" for t in self.terms)
        return f"RewardChain({inner})"

    # ------------------------------------------------------------------------- generated source

    def source(self) -> str:
        """The Mojo module: ``kernels/rewards.mojo`` followed by the generated ``reward_chain``."""
        if self._source is None:
            base = loader.read_source(loader.kernel_dir() / "rewards.mojo")
            self._source = base.rstrip() + "\n\n\n" + _generate(self.terms, self._accs)
        return self._source

    def _buffers(self) -> tuple[Tensor, Tensor]:
        """int64 params: per term k slots 2k, 2k+1 (n | lo, hi | m, pattern offset), then pattern
        tokens; float64 params: weights, then per-term scale."""
        K = len(self.terms)
        ints: list[int] = [0] * (2 * K)
        floats = [t.weight for t in self.terms] + [0.0] * K
        for k, t in enumerate(self.terms):
            if "n" in t.params:
                ints[2 * k] = t.params["n"]
            elif t.kind == "length":
                ints[2 * k], ints[2 * k + 1], floats[K + k] = t.params["lo"], t.params["hi"], t.params["scale"]
            else:
                ints[2 * k], ints[2 * k + 1] = len(t.params["pattern"]), len(ints)
                ints.extend(t.params["pattern"].tolist())
        return torch.tensor(ints, dtype=torch.int64), torch.tensor(floats, dtype=torch.float64)

    # ------------------------------------------------------------------------- running

    def kernel(self) -> loader.Kernel:
        """The built fused kernel (raises KernelError when Mojo is unavailable or the build fails)."""
        return loader.compile_source("reward_chain", self.source())

    def __call__(self, ids_B_T: Tensor, lengths_B: Tensor, *, impl: str = "auto") -> tuple[Tensor, dict[str, Tensor]]:
        """(weighted total (B,), {label: unweighted (B,)}), float64. ``impl`` as in ``rewards``;
        without Mojo (or ``impl="torch"``) this is ``separate(..., impl="torch")``."""
        ids, lengths = R._check_ids("reward_chain", ids_B_T, lengths_B)
        kernel = self._resolve(impl, ids)
        if kernel is None:
            return self.separate(ids, lengths, impl="torch")
        B, T = ids.shape
        K = len(self.terms)
        ip, fp = self._buffers()
        cap = R.scratch_capacity(T)
        n_ngram = sum(1 for kind, _ in self._accs if kind == "ngram")
        scratch = torch.empty(max(2 * cap * n_ngram, 1), dtype=torch.int64)
        out = torch.empty(K + 1, B, dtype=torch.float64)
        R._call(kernel, "reward_chain", "reward_chain", "iiiiiiiii", ids.data_ptr(), lengths.data_ptr(), B, T,
                ip.data_ptr(), fp.data_ptr(), scratch.data_ptr(), cap, out.data_ptr())
        return out[0], dict(zip(self.labels, out[1:]))

    def _resolve(self, impl: str, ids: Tensor) -> loader.Kernel | None:
        if impl not in R.IMPLS:
            raise ConfigError(f"reward_chain: impl must be one of {', '.join(R.IMPLS)}; got {impl!r}")
        if impl == "torch" or loader.disabled() or ids.device.type != "cpu":
            if impl == "mojo":
                raise KernelError("reward_chain: Mojo is disabled or the tensors are not on the CPU")
            return None
        try:
            return self.kernel()
        except KernelError as e:
            if impl == "mojo":
                raise
            loader.warn_once("reward_chain", str(e))
            return None

    def separate(self, ids_B_T: Tensor, lengths_B: Tensor, *, impl: str = "auto") -> tuple[Tensor, dict[str, Tensor]]:
        """The same result from one call per reward (the unfused reference)."""
        parts = {}
        for label, t in zip(self.labels, self.terms):
            if t.kind == "length":
                parts[label] = R.length(lengths_B, range=(t.params["lo"], t.params["hi"]), scale=t.params["scale"],
                                        impl=impl)
            elif t.kind == "pattern_match":
                parts[label] = R.pattern_match(ids_B_T, lengths_B, t.params["pattern"], impl=impl)
            else:
                parts[label] = R.KERNEL_REWARDS[t.kind](ids_B_T, lengths_B, n=t.params["n"], impl=impl)
        total = None
        for label, t in zip(self.labels, self.terms):
            term = t.weight * parts[label]
            total = term if total is None else total + term
        return total, parts


def _labels(kinds: Sequence[str]) -> list[str]:
    """Unique labels: repeated kinds get ``_2``, ``_3``... (as ``materl.ops.rewards`` names parts)."""
    out: list[str] = []
    for kind in kinds:
        label, k = kind, 2
        while label in out:
            label, k = f"{kind}_{k}", k + 1
        out.append(label)
    return out


def _generate(terms: Sequence[_Term], accs: Sequence[tuple[str, int]]) -> str:
    """The ``reward_chain`` entry point: one pass per row stepping every accumulator."""
    K = len(terms)
    g = [
        "# ---- generated by materl.kernels.fusion: " + " + ".join(t.kind for t in terms),
        "@export",
        "def reward_chain(ids_addr: Int, lens_addr: Int, B: Int, T: Int, ip_addr: Int, fp_addr: Int,",
        '                 scratch_addr: Int, cap_max: Int, out_addr: Int) abi("C") -> Int:',
        '    """Set out[0, b] = weighted total and out[k + 1, b] = term k of row b, in one pass per row."""',
        "    var ids = I64Ptr(unsafe_from_address=ids_addr)",
        "    var lens = I64Ptr(unsafe_from_address=lens_addr)",
        "    var ip = I64Ptr(unsafe_from_address=ip_addr)",
        "    var fp = F64Ptr(unsafe_from_address=fp_addr)",
        "    var scratch = I64Ptr(unsafe_from_address=scratch_addr)",
        "    var out = F64Ptr(unsafe_from_address=out_addr)",
        "    if not check_lengths(lens, B, T):",
        "        return -1",
        "    if cap_max < next_pow2(2 * T):",
        "        return -2",
        "    for b in range(B):",
        "        var L = Int(lens[unsafe_offset=b])",
        "        var row = ids.unsafe_offset(b * T)",
    ]
    first_term = {a: next(k for k, t in enumerate(terms) if t.acc == a) for a in range(len(accs))}
    ngram_slot = 0
    for a, (kind, _) in enumerate(accs):
        k = first_term[a]
        if kind == "ngram":
            g.append(f"        var acc{a} = NGramCounter(scratch.unsafe_offset({2 * ngram_slot} * cap_max), cap_max, "
                     f"Int(ip[unsafe_offset={2 * k}]), L)")
            ngram_slot += 1
        else:
            g.append(f"        var acc{a} = PatternMatcher(ip.unsafe_offset(Int(ip[unsafe_offset={2 * k + 1}])), "
                     f"Int(ip[unsafe_offset={2 * k}]))")
    if accs:
        g.append("        for t in range(L):")
        g += [f"            acc{a}.step(row, t)" for a in range(len(accs))]
    for k, t in enumerate(terms):
        expr = {
            "repetition": f"acc{t.acc}.repetition()",
            "diversity": f"acc{t.acc}.diversity()",
            "pattern_match": f"acc{t.acc}.value()",
            "length": f"length_score(L, Int(ip[unsafe_offset={2 * k}]), Int(ip[unsafe_offset={2 * k + 1}]), "
                      f"fp[unsafe_offset={K + k}])",
        }[t.kind]
        g.append(f"        var v{k} = {expr}")
        g.append(f"        out[unsafe_offset={k + 1} * B + b] = v{k}")
    g.append("        var total = fp[unsafe_offset=0] * v0")
    g += [f"        total = total + fp[unsafe_offset={k}] * v{k}" for k in range(1, K)]
    g += ["        out[unsafe_offset=b] = total", "    return 0", ""]
    return "\n".join(g)


# ----------------------------------------------------------------------------- user kernels

_SHAPES = ("B", "B,T")


@dataclass
class UserKernel:
    """A user's Mojo function, called once per batch with the convention in the module docstring."""

    path: Path
    fn_name: str
    outputs: dict[str, str]
    kernel: loader.Kernel = field(repr=False)

    def __call__(self, *inputs) -> dict[str, Tensor]:
        args, sig, shape, keep = [], [], None, []
        for i, x in enumerate(inputs):
            if isinstance(x, Tensor):
                t = (x.to(torch.float64) if x.is_floating_point() else x.to(torch.int64)).contiguous()
                keep.append(t)
                args.append(t.data_ptr())
                sig.append("i")
                shape = shape or (t.shape[0], t.shape[1] if t.dim() > 1 else 1)
            elif isinstance(x, bool) or isinstance(x, int):
                args.append(int(x))
                sig.append("i")
            elif isinstance(x, float):
                args.append(x)
                sig.append("f")
            elif isinstance(x, Sequence) and all(isinstance(r, Sequence) for r in x):
                ids, lengths = R.pad_ids(x)
                keep += [ids, lengths]
                args += [ids.data_ptr(), lengths.data_ptr()]
                sig += ["i", "i"]
                shape = shape or (ids.shape[0], ids.shape[1])
            else:
                raise ConfigError(f"mojo op {self.fn_name!r}: argument {i} is a {type(x).__name__}; pass tensors, "
                                  f"lists of token-id lists, ints or floats")
        if shape is None:
            raise ConfigError(f"mojo op {self.fn_name!r} needs at least one tensor or token-id batch to size B, T")
        B, T = shape
        outs = {name: torch.zeros((B, T) if spec == "B,T" else (B,), dtype=torch.float64)
                for name, spec in self.outputs.items()}
        args += [o.data_ptr() for o in outs.values()] + [B, T]
        sig += ["i"] * (len(outs) + 2)
        rc = self.kernel.function(self.fn_name, "".join(sig))(*args)
        if rc != 0:
            raise KernelError(f"mojo op {self.fn_name!r} ({self.path}) returned error code {rc}")
        return outs


def _resolve_path(path: str | Path) -> Path:
    p = Path(path)
    if p.is_file():
        return p
    shipped = loader.kernel_dir() / p.name
    if not p.is_absolute() and p.parent.name == "kernels" and shipped.is_file():
        return shipped  # "kernels/x.mojo" from outside the repository: the installed copy
    raise KernelError(f"Mojo kernel file not found: {str(path)!r} (looked in {Path.cwd()}"
                      f"{' and ' + str(loader.kernel_dir()) if p.parent.name == 'kernels' else ''})")


def _outputs(outputs: Sequence[str] | Mapping[str, str]) -> dict[str, str]:
    spec = dict(outputs) if isinstance(outputs, Mapping) else {name: "B" for name in outputs}
    if not spec:
        raise ConfigError("a mojo op needs at least one output name, got none")
    for name, shape in spec.items():
        if not str(name).isidentifier() or shape not in _SHAPES:
            raise ConfigError(f"mojo op output {name!r}: {shape!r}; names are identifiers, shapes {_SHAPES}")
    return spec


def load_user_kernel(path: str | Path, fn_name: str, outputs: Sequence[str] | Mapping[str, str]) -> UserKernel:
    """Build the user's ``path`` (cached) and return its ``fn_name`` as a callable; see the module
    docstring for the convention. Raises KernelError for a missing file, a compile error (with the
    compiler's message), or a missing/unexported function (listing the exported ones)."""
    spec = _outputs(outputs)
    p = _resolve_path(path)
    kernel = loader.compile_file(p)
    source = loader.read_source(p)
    exported = re.findall(r"@export[^\n]*\n\s*(?:fn|def)\s+(\w+)", source)
    if fn_name not in exported:
        raise KernelError(
            f"{p} exports no function {fn_name!r} with @export; exported: {', '.join(exported) or 'none'}")
    return UserKernel(p, fn_name, spec, kernel)
