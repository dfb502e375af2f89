"""Demo: compile a real Triton kernel, pack the cache, unpack it under another root, and show the cache hit.

Runs on a machine without a GPU: Triton compiles for an explicit target (cuda:90) without running anything.
Usage: python examples/demo.py
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


@triton.jit
def fused_add_relu(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    out = tl.maximum(tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), 0.0)
    tl.store(out_ptr + offs, out, mask=mask)


def compile_into(root: str) -> tuple[float, bool | None]:
    """Compile the kernel with Triton's cache at ``root``; return seconds and the listener's cache_hit."""
    os.environ["TRITON_CACHE_DIR"] = root
    hit: list[bool] = []
    if hasattr(triton, "knobs"):
        triton.knobs.compilation.listener = lambda **kw: hit.append(kw["cache_hit"])
    signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    src = ASTSource(fn=fused_add_relu, signature=signature, constexprs={"BLOCK": 1024})
    start = time.perf_counter()
    triton.compile(src, target=GPUTarget("cuda", 90, 32))
    return time.perf_counter() - start, (hit[0] if hit else None)


def tritonpack(*args: str) -> None:
    print("$ tritonpack", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "tritonpack", *args], check=True)


def main() -> None:
    work = tempfile.mkdtemp(prefix="tritonpack-demo-")
    build_root, deploy_root = os.path.join(work, "build", "cache"), os.path.join(work, "deploy", "cache")
    archive = os.path.join(work, "kernels.tpack")

    seconds, hit = compile_into(build_root)
    print(f"compiled fused_add_relu for cuda:90 into {build_root}: {seconds * 1000:.0f} ms (cache hit: {hit})")
    tritonpack("pack", build_root, "-o", archive)
    tritonpack("list", archive)
    shutil.rmtree(os.path.join(work, "build"))
    print(f"deleted {build_root}")
    tritonpack("unpack", archive, "--cache-dir", deploy_root)
    seconds, hit = compile_into(deploy_root)
    print(f"compiled again against {deploy_root}: {seconds * 1000:.0f} ms (cache hit: {hit})")
    shutil.rmtree(work)
    if hit is False:
        sys.exit("demo failed: the unpacked cache was not hit")


if __name__ == "__main__":
    main()
