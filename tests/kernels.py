"""Real Triton kernels compiled without a GPU (``triton.compile`` with an explicit ``GPUTarget``)."""
from __future__ import annotations

import contextlib
import os

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
HAS_LISTENER = hasattr(triton, "knobs") and hasattr(triton.knobs, "compilation")


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


@triton.jit
def softmax_kernel(out_ptr, in_ptr, stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(in_ptr + row * stride + cols, mask=cols < n_cols, other=-float("inf"))
    x = x - tl.max(x, axis=0)
    num = tl.exp(x)
    tl.store(out_ptr + row * stride + cols, num / tl.sum(num, axis=0), mask=cols < n_cols)


@triton.jit
def scale_kernel(x_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * alpha, mask=offs < n)


SOURCES = [
    (add_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
     {"BLOCK": 1024}),
    (softmax_kernel, {"out_ptr": "*fp32", "in_ptr": "*fp32", "stride": "i32", "n_cols": "i32",
                      "BLOCK": "constexpr"}, {"BLOCK": 256}),
    (scale_kernel, {"x_ptr": "*fp16", "n": "i32", "alpha": "fp32", "BLOCK": "constexpr"}, {"BLOCK": 512}),
]


def source(fn, signature: dict[str, str], constexprs: dict[str, object]) -> ASTSource:
    """A kernel's ``ASTSource``: before 3.3 Triton takes the constexprs as ``constants``, outside the signature."""
    if TRITON_VERSION >= (3, 3):
        return ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return ASTSource(fn=fn, signature={k: v for k, v in signature.items() if v != "constexpr"}, constants=constexprs)


def links_amd() -> bool:
    """Whether this Triton can compile for AMD here: 3.5+ link AMD code themselves; 3.0-3.4 run ROCm's ld.lld, which
    the wheel lacks, even to hash the backend (``TRITON_HIP_LLD_PATH`` may name one)."""
    if TRITON_VERSION >= (3, 5):
        return True
    from triton.backends.amd.compiler import HIPBackend

    try:
        HIPBackend.path_to_rocm_lld()
    except Exception:  # "ROCm linker /opt/rocm/llvm/bin/ld.lld not found"
        return False
    return True


def targets() -> list[GPUTarget]:
    """cuda:90 and cuda:80 everywhere; hip:gfx942 where this Triton can compile for AMD (``links_amd``)."""
    result = [GPUTarget("cuda", 90, 32), GPUTarget("cuda", 80, 32)]
    if links_amd():
        result.append(GPUTarget("hip", "gfx942", 64))
    return result


@contextlib.contextmanager
def cache_dir(path):
    """Point Triton at ``path`` for the duration (Triton reads TRITON_CACHE_DIR at every compile)."""
    old = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(path)
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_CACHE_DIR"]
        else:
            os.environ["TRITON_CACHE_DIR"] = old


def compile_all(root) -> list[bool | None]:
    """Compile every kernel for every target into ``root``; returns the listener's cache_hit per compile
    (``None`` per compile where Triton has no listener)."""
    hits: list[bool | None] = []
    with cache_dir(root):
        listener = None
        if HAS_LISTENER:
            def listener(**kw):
                hits.append(kw["cache_hit"])
            previous, triton.knobs.compilation.listener = triton.knobs.compilation.listener, listener
        try:
            for fn, signature, constexprs in SOURCES:
                for target in targets():
                    triton.compile(source(fn, signature, constexprs), target=target)
                    if not HAS_LISTENER:
                        hits.append(None)
        finally:
            if HAS_LISTENER:
                triton.knobs.compilation.listener = previous
    return hits
