"""Prepacked weights for the few-row matmuls of a verify step on CPU.

A decode step multiplies every weight matrix by ONE row, which CPU BLAS runs as a streaming GEMV. A
verify step multiplies it by the 4-16 rows of a draft tree, and there `F.linear` switches to a GEMM that
repacks the weight on every call: a forward over a few tokens then costs nearly twice a one-token forward,
which eats most of what speculation gains. Packing each weight once into oneDNN's blocked layout (what
torch.compile's CPU freezing does) brings it close to a one-token forward, and below it on two threads, where the
packed GEMM uses both cores and the stock GEMV does not (docs/benchmarks.md; `scripts/forward_cost.py` measures it).

`prepacked_linears(model, cache=...)` switches a model's `nn.Linear` layers to the packed weights for
inputs of 2+ rows while it is active, and back afterwards; one-row calls keep the GEMV. The packed copies
live in a `PackCache` the caller owns (SelfSpecModel keeps one), keyed weakly by the weight tensor and
repacked if a weight changes: nothing is left on the user's modules, which stay deep-copyable and savable.
The cost is a second copy of the linear weights in RAM while the cache lives.

On some CPUs oneDNN's packed GEMM is itself the slow part, well above the one-row GEMV's memory floor at 2-8
rows. `few_rows_linear` (infer/cpu/kernels/few_rows_linear.cpp, compiled on first use with the machine's own
instruction set) streams each weight row once with software prefetch and stays near that floor there
(docs/benchmarks.md). Which one wins
is the machine's business, so `prepacked_linears(stream_rows=n)` sends blocks of 2..n rows to it and larger
ones to oneDNN, and `infer.tuning.plan.stream_rows` measures n once per machine and target shape. The same
extension serves `infer.cpu.lean_forward`, the verify forward of Llama-layout targets without transformers'
module machinery, with two more functions (several weights in one pass, RMSNorm).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
import warnings
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def worth_it(model: nn.Module, max_ram_fraction: float = 0.25) -> bool:
    """Default policy: a CPU fp32 model whose linear weights (to be copied) take at most a quarter of RAM, or a CPU
    bf16 model (its weights stream in place: no copy)."""
    params = list(model.parameters())
    if not params or params[0].device.type != "cpu" or not available():
        return False
    if params[0].dtype == torch.bfloat16:
        return True
    if params[0].dtype != torch.float32:
        return False
    linear_bytes = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, nn.Linear))
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return False
    return linear_bytes <= max_ram_fraction * ram


class PackCache:
    """Copies derived from weight tensors (oneDNN's packed layout, `infer.cpu.argmax_head.ArgmaxHead`'s int8 head),
    keyed by the tensor's identity and the kind of copy, remade when the tensor changes in place and dropped
    when it is freed."""

    def __init__(self):
        # (id, kind) -> (ref, version, derived)
        self._derived: dict[tuple[int, str], tuple[weakref.ref, int, object]] = {}
        self.owner: weakref.ref | None = None  # the model whose engines share it (`shared_pack_cache`)

    def __len__(self) -> int:
        return len(self._derived)

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` in oneDNN's packed layout for `torch.ops.mkldnn._linear_pointwise`."""
        return self.derived(weight, "onednn", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None))

    def derived(self, weight: torch.Tensor, kind: str, make):
        """`make(weight.detach())`, made once per weight and `kind` while the weight lives unchanged."""
        key = (id(weight), kind)
        cached = self._derived.get(key)
        if cached is None or cached[0]() is not weight or cached[1] != weight._version:
            with torch.no_grad():
                made = make(weight.detach())
            ref = weakref.ref(weight, lambda _, key=key, cache=self._derived: cache.pop(key, None))
            cached = self._derived[key] = (ref, weight._version, made)
        return cached[2]


_shared_lock = threading.Lock()
_shared: weakref.WeakValueDictionary[int, PackCache] = weakref.WeakValueDictionary()  # id(model) -> its cache


def shared_pack_cache(model: nn.Module) -> PackCache:
    """The `PackCache` that every engine over `model` holds while any of them does: one packed copy of a weight
    however many engines run it (an fp32 1B target's copy is 5 GB; a benchmark's dozen engines over one target each
    packing their own ran a 24 GB machine out of memory), freed with the last engine that held it."""
    with _shared_lock:
        cache = _shared.get(id(model))
        if cache is None or cache.owner() is not model:  # none yet, or another model's at a reused address
            cache = PackCache()
            cache.owner = weakref.ref(model)
            _shared[id(model)] = cache
        return cache


def _forward(layer: nn.Linear, plain_forward):
    """The layer's forward while any block patches it: the packed or streamed path where the calling thread is in
    a block that covers the layer, else the layer's own (another thread, sharing the model, asked for nothing)."""
    key = id(layer)

    def forward(x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features]; autograd, torch.compile tracing or another device -> the plain path
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or x.device.type != "cpu":
            return plain_forward(x)
        setting = getattr(_this_thread, "layers", {}).get(key)
        if setting is None:
            return plain_forward(x)
        cache, stream_rows, kernel, one_row = setting
        if x.dtype == layer.weight.dtype == torch.bfloat16:
            return _bf16_forward(layer, x, rows, stream_rows, kernel, plain_forward)
        if x.dtype != torch.float32 or layer.weight.dtype != torch.float32 or rows < 1:
            return plain_forward(x)
        if rows == 1 and not (one_row and kernel is not None):
            return plain_forward(x)  # one row (decode): torch's GEMV, where it keeps pace (`stream_one_row`)
        if kernel is not None and (rows == 1 or rows <= stream_rows):
            y = kernel.few_rows_linear(x.reshape(rows, x.shape[-1]), layer.weight, layer.bias)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return torch.ops.mkldnn._linear_pointwise(x, cache.get(layer.weight), layer.bias, "none", [], "")
    return forward


def _bf16_forward(layer: nn.Linear, x: torch.Tensor, rows: int, stream_rows: int, kernel, plain_forward):
    """A bf16 layer on 1..stream_rows rows through the streamed kernel: bf16 products (exact in fp32) summed in fp32,
    by pairs on a CPU with AVX512-BF16 (the weight widened as it streams elsewhere), the output rounded to bf16 once,
    as torch's bf16 matmul rounds it. torch's own bf16 GEMV on a CPU reads its weight far below the memory's pace
    (docs/benchmarks.md)."""
    if kernel is None or not 1 <= rows <= stream_rows:
        return plain_forward(x)
    bias = None if layer.bias is None else layer.bias.float()
    y = kernel.few_rows_linear(x.reshape(rows, x.shape[-1]), layer.weight, bias)
    return y.to(torch.bfloat16).reshape(*x.shape[:-1], y.shape[-1])


def _plain(weight: torch.Tensor) -> bool:
    """A dense tensor (not a quantized tensor subclass, whose kernels are its own)."""
    return type(weight) in (nn.Parameter, torch.Tensor) and type(weight.data) is torch.Tensor


# Models are shared between threads (two SelfSpecModels over one target): a layer's forward is patched while any
# block holds it and restored when the last one leaves, and each thread's blocks say what its own calls run on.
_patch_lock = threading.Lock()
_patched: dict[int, list] = {}  # id(layer) -> [the patched forward, blocks holding it (any thread)]
_this_thread = threading.local()  # .layers: id(layer) -> (cache, stream_rows, kernel, one_row) of its blocks


@contextlib.contextmanager
def prepacked_linears(*models: nn.Module | None, cache: PackCache | None = None, enabled: bool = True,
                      stream_rows: int = 0, one_row: bool = False):
    """Within the block, the `nn.Linear` layers of `models` run multi-row fp32 CPU inputs on packed weights
    from `cache` (a fresh one, dropped at exit, if None); blocks of 2..`stream_rows` rows run on the
    streamed kernel instead, where it could be built, and with `one_row` one fp32 row too (else torch's GEMV). Only
    the calling thread's forwards: another thread using the same layers meanwhile runs them as they are, or as its
    own block says."""
    cache = PackCache() if cache is None else cache
    with _patch_lock:
        found = {id(m): m for model in models if model is not None and enabled for m in model.modules()
                 if type(m) is nn.Linear and _plain(m.weight) and _patchable(m)}  # a shared lm_head counts once
        layers = list(found.values())
        for layer in layers:
            if id(layer) not in _patched:
                _patched[id(layer)] = [_forward(layer, layer.forward), 0]
                layer.forward = _patched[id(layer)][0]
            _patched[id(layer)][1] += 1
    outer = getattr(_this_thread, "layers", {})
    _this_thread.layers = {**outer, **{id(layer): (cache, stream_rows, streamed_kernel() if (stream_rows > 0 or one_row)
                                                   and layer.weight.is_contiguous() else None, one_row)
                                       for layer in layers}}
    try:
        yield
    finally:
        _this_thread.layers = outer
        with _patch_lock:
            for layer in layers:
                entry = _patched[id(layer)]
                entry[1] -= 1
                if entry[1] == 0:
                    del _patched[id(layer)]
                    del layer.forward


def _patchable(layer: nn.Linear) -> bool:
    """The layer runs its class's forward, or the patch of a block under way (not a forward of someone else's)."""
    own = layer.__dict__.get("forward")
    return own is None or (id(layer) in _patched and own is _patched[id(layer)][0])


# ------------------------------------------------------------------------------------ the streamed kernel
KERNEL_SOURCE = Path(__file__).parent / "kernels" / "few_rows_linear.cpp"


@functools.cache
def streamed_kernel():
    """The compiled `few_rows_linear` extension, or None (with one warning) where it cannot be built.

    Compiled with `-march=native` on first use (about 25 s) into `<selfspec cache>/kernels/`, under a name
    that hashes the source, the CPU's instruction-set flags and the torch version, so another machine or
    torch builds its own."""
    return build_kernel()


def build_kernel(extra_cflags: tuple[str, ...] = ()):
    """`streamed_kernel`'s build, with `extra_cflags` after `-march=native` (e.g. `-mno-avx512f`: the AVX2
    code on an AVX-512 machine, as tests build it); cached under a name that hashes them too."""
    from torch.utils.cpp_extension import load

    from ..embedded import cache_dir

    source = KERNEL_SOURCE.read_bytes()
    flags = ["-O3", "-march=native", *extra_cflags, "-fopenmp"]
    key = hashlib.sha256(source + cpu_flags().encode() + torch.__version__.encode()
                         + " ".join(flags).encode()).hexdigest()[:12]
    name = f"selfspec_few_rows_{key}"
    folder = cache_dir() / "kernels" / name
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / f"{name}.so").exists():
        print(f"selfspec: compiling the CPU verify kernel for this machine, once (about 25 s) -> {folder}",
              file=sys.stderr, flush=True)
    try:
        with _ninja_on_path():
            return load(name, [str(KERNEL_SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                        build_directory=str(folder), verbose=False)
    except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as err:
        warnings.warn(f"could not build selfspec's streamed CPU kernel ({type(err).__name__}: "
                      f"{str(err).strip().splitlines()[-1] if str(err).strip() else err!r}); verify steps use "
                      "oneDNN's packed GEMM instead. It needs a C++ compiler and ninja (`pip install ninja`).",
                      stacklevel=3)
        return None


@contextlib.contextmanager
def _ninja_on_path():
    """torch builds with the `ninja` on PATH; a virtual environment that is not activated has pip's ninja
    (a dependency) only in its own bin folder, so put that on PATH for the build."""
    saved = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            pass
        else:
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + saved
    try:
        yield
    finally:
        os.environ["PATH"] = saved


def cpu_flags() -> str:
    """This CPU's instruction-set flags: /proc/cpuinfo's `flags` (x86) or `Features` (Arm) line, else the platform's
    name for the processor."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


GROUP = 32  # inputs per scale (and offset) of the kernel's grouped weights: GGUF's Q4_1 and Q8_0 blocks


def groups_fit(weight: torch.Tensor) -> bool:
    """Whether a [out, in] weight can be held in groups of `GROUP` inputs (`Int4Linear`, `Int8Linear(group=True)`)."""
    return weight.shape[1] % GROUP == 0


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An fp32 weight [N, K] in 4-bit groups of `GROUP` inputs, asymmetric (GGUF's Q4_1): (q [N, K / 2] uint8,
    two a byte, the group's input j in the low nibble of its byte j and input j + 16 in the high one; scale and low
    [N, K / GROUP] fp32), weight ~ q * scale + low. For weights dequantized from Q4_1 (the embedded SmolLM2 target)
    this finds their q, scale and low again: q * scale + low gives back every weight exactly."""
    with torch.no_grad():
        out_features, in_features = weight.shape
        groups = weight.reshape(out_features, in_features // GROUP, GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        halves = q.reshape(out_features, in_features // GROUP, 2, GROUP // 2)
        packed = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(out_features, in_features // 2)
    return packed.contiguous(), scale.contiguous(), low.contiguous()


def int4_weight(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] that `int4_groups`' (q, scale, low) hold."""
    out_features = q.shape[0]
    bytes_ = q.reshape(out_features, -1, GROUP // 2)  # [N, K / GROUP, 16]
    groups = torch.cat((bytes_ & 15, bytes_ >> 4), -1).float()  # [N, K / GROUP, 32]: inputs j, then j + 16
    return (groups * scale[..., None] + low[..., None]).reshape(out_features, -1)


def int4_exact(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`int4_groups(weight)` where those hold `weight` exactly, else None. Exactly: `int4_weight` gives back every
    weight bit for bit, as for weights dequantized from GGUF's Q4_1 (the embedded SmolLM2's layers). The kernel
    rebuilds such weights in registers as `int4_weight` does and multiplies them as the fp32 weight, so it computes
    the same bits from a fifth of the bytes."""
    return _exact(weight, int4_groups, int4_weight)


def int8_exact(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`int8_groups(weight)` where those hold `weight` exactly (`int8_weight` gives back every weight bit for bit, as
    for weights dequantized from GGUF's Q8_0: the embedded SmolLM2's tied embedding and LM head), else None. The
    kernel computes the same bits from them as from the fp32 weight, from a quarter of the bytes."""
    return _exact(weight, int8_groups, int8_weight)


def exact_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The groups that hold `weight` exactly, the fewer bytes first: (q, scale, low) of 4-bit groups (`int4_exact`),
    else (q, scale, None) of int8 groups (`int8_exact`), else None."""
    groups = int4_exact(weight)
    if groups is None:
        groups = int8_exact(weight)
        groups = None if groups is None else (*groups, None)
    return groups


def _exact(weight: torch.Tensor, find, rebuild):
    """`find(weight)` where `rebuild` of it gives back `weight` bit for bit, else None."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or not groups_fit(weight) or not _plain(weight):
        return None
    with torch.no_grad():
        if not torch.equal(rebuild(*find(weight[:1])), weight[:1]):  # most weights fail on their first row
            return None
        groups = find(weight)
        return groups if torch.equal(rebuild(*groups), weight) else None


class Int4Linear(nn.Module):
    """A linear layer whose weight is held as 4-bit integers in groups of `GROUP` inputs, each group with its
    own scale and offset (`int4_groups`: w = q * scale + low, q in 0..15, GGUF's Q4_1). A target dequantized from a
    Q4_1 file, as the embedded SmolLM2 is, is held again exactly, in 6 bits a weight (the scale and offset in fp32)
    where fp32 takes 32; other weights to within half a step of their group.

    fp32 inputs of up to `KERNEL_ROWS` rows run on the streamed kernel (fp32 products and sums, the weight
    dequantized in registers as it streams); others, and any input without the kernel, multiply the dequantized
    fp32 weight, made at each call. The output comes back in the input's dtype."""

    KERNEL_ROWS = 16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if not groups_fit(weight):
            raise ValueError(f"int4 needs in_features divisible by {GROUP}; got {tuple(weight.shape)}")
        q, scale, low = int4_groups(weight.detach().float())
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("low", low, persistent=False)
        self.bias = None if bias is None else bias.detach().clone()
        self.out_features = weight.shape[0]

    def weight_fp32(self) -> torch.Tensor:
        """The fp32 weight [out, in] this layer holds."""
        return int4_weight(self.q, self.scale, self.low)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        rows = x.reshape(-1, x.shape[-1])
        kernel = streamed_kernel() if x.dtype == torch.float32 and rows.shape[0] <= self.KERNEL_ROWS else None
        if kernel is not None:
            y = kernel.few_rows_linear_cat(rows, [self.q], [None], [self.scale], [self.low])
        else:
            y = F.linear(rows.float(), self.weight_fp32()).to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 weight [N, K] as int8 rows with one fp32 scale each (symmetric): (q [N, K] int8 contiguous,
    scale [N]), weight ~ q * scale[:, None]."""
    with torch.no_grad():
        scale = (weight.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [N]
        q = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale


def int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 weight [N, K] as int8 in groups of `GROUP` inputs, symmetric (GGUF's Q8_0): (q [N, K] int8, scale
    [N, K / GROUP] fp32), weight ~ q * scale. Weights dequantized from Q8_0 (the embedded SmolLM2's tied embedding
    and LM head) come back exactly."""
    with torch.no_grad():
        out_features, in_features = weight.shape
        groups = weight.reshape(out_features, in_features // GROUP, GROUP)
        scale = (groups.abs().amax(-1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q = (groups / scale[..., None]).round().clamp(-127, 127).to(torch.int8).reshape(out_features, in_features)
    return q.contiguous(), scale.contiguous()


def int8_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] that `int8_groups`' (q, scale) hold: q * scale, one fp32 product a weight (as the
    kernel rebuilds it)."""
    return (q.reshape(q.shape[0], -1, GROUP) * scale[..., None]).reshape(q.shape)


class Int8Linear(nn.Module):
    """A linear layer whose weight is held as int8 (symmetric) with one scale a row, or with `group=True` one
    scale a group of `GROUP` inputs (`int8_groups`, GGUF's Q8_0: a weight dequantized from Q8_0 is held again
    exactly); the output comes back in the input's dtype. Half of bf16's bytes per weight; for weights on no
    4-bit grid, closer to them than `Int4Linear`.

    fp32 inputs of up to `KERNEL_ROWS` rows (a draft token, a catch-up block) run on the streamed kernel's
    int8 rows (fp32 products and sums, the int8 weight read once). Other inputs run torch's CPU int8
    weight-only kernel with bfloat16 activations (one scale a row; grouped weights multiply their dequantized fp32
    weight), more than twice the streamed kernel's time at one row, and its bf16 activations move the drafts further
    from the target's."""

    KERNEL_ROWS = 16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group: bool = False):
        super().__init__()
        if group and not groups_fit(weight):
            raise ValueError(f"int8 groups need in_features divisible by {GROUP}; got {tuple(weight.shape)}")
        q, scale = (int8_groups if group else int8_rows)(weight.detach().float())
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        if not group:
            self.register_buffer("scale_bf16", scale.to(torch.bfloat16), persistent=False)  # torch's kernel's
        self.bias = None if bias is None else bias.detach().clone()
        self.out_features, self.group = weight.shape[0], group

    def weight_fp32(self) -> torch.Tensor:
        """The fp32 weight [out, in] this layer holds."""
        if self.group:
            return int8_weight(self.q, self.scale)
        return self.q.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        rows = x.reshape(-1, x.shape[-1])
        kernel = streamed_kernel() if x.dtype == torch.float32 and rows.shape[0] <= self.KERNEL_ROWS else None
        if kernel is not None:
            y = kernel.few_rows_linear_cat(rows, [self.q], [None], [self.scale])
        elif self.group:
            y = F.linear(rows.float(), self.weight_fp32()).to(x.dtype)
        else:
            y = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), self.q, self.scale_bf16).to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

