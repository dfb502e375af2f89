"""Generate a large, realistic Triton cache from real compiles, no GPU needed.

Inductor-like kernels: fused pointwise chains (`triton_poi_fused_*`), row reductions (`triton_red_fused_*`) and
matmuls of a transformer's shapes in Inductor's template with fused epilogues, each shape at all 19 of Inductor's
max-autotune configs (half the groups, as in a real max-autotune cache), each compiled for cuda:80, cuda:90 and
hip:gfx942. Each kernel's source is generated into a module file of its own, as Inductor writes each kernel (Triton
reads a kernel's source through inspect), deterministic per seed.
Usage: python bench/make_large_cache.py OUT_DIR [--kernels 1200] [--jobs 2]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import random
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor

warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset")

OPS = [("add", "{a} + {b}"), ("mul", "{a} * {b}"), ("sub", "{a} - {b}"), ("max", "tl.maximum({a}, {b})"),
       ("relu", "tl.maximum({a}, 0.0)"), ("exp", "tl.exp({a})"), ("sigmoid", "tl.sigmoid({a})"),
       ("abs", "tl.abs({a})"), ("sqrt", "tl.sqrt(tl.abs({a}) + 1e-6)"), ("tanh", "tl.sigmoid({a}) * 2.0 - 1.0"),
       ("log", "tl.log(tl.abs({a}) + 1.0)"), ("div", "{a} / ({b} + 2.0)")]


def _pointwise(i: int, rng: random.Random) -> tuple[str, str, int]:
    """A fused pointwise chain whose inputs broadcast along rows or columns, as Inductor's do."""
    inputs = rng.randint(1, 6)
    ops = [rng.choice(OPS) for _ in range(rng.randint(3, 12))]
    name = f"triton_poi_fused_{'_'.join(o[0] for o in ops[:4])}_{i}"
    args = ", ".join(f"in_ptr{k}" for k in range(inputs))
    lines = ["@triton.jit", f"def {name}({args}, out_ptr0, xnumel, XBLOCK: tl.constexpr):",
             "    xoffset = tl.program_id(0) * XBLOCK", "    xindex = xoffset + tl.arange(0, XBLOCK)",
             "    xmask = xindex < xnumel", f"    x0 = xindex % {rng.choice(MM_DIMS)}",
             f"    x1 = xindex // {rng.choice(MM_DIMS)}"]
    for k in range(inputs):
        where = rng.choice(("xindex", "xindex", "x0", "x1"))
        lines.append(f"    tmp{k} = tl.load(in_ptr{k} + {where}, xmask).to(tl.float32)")
    cur = "tmp0"
    for n, (_, expr) in enumerate(ops):
        other = f"tmp{rng.randrange(inputs)}"
        lines.append(f"    t{n} = {expr.format(a=cur, b=other)}")
        cur = f"t{n}"
    lines.append(f"    tl.store(out_ptr0 + xindex, {cur}, xmask)")
    return name, "\n".join(lines), inputs


def _reduction(i: int, rng: random.Random) -> tuple[str, str, int]:
    """A looped row reduction over two inputs (a row and a broadcast weight), as Inductor's ``triton_red``."""
    red, combine, init = rng.choice([("sum", "{a} + {b}", "0.0"), ("max", "tl.maximum({a}, {b})", "float('-inf')"),
                                     ("min", "tl.minimum({a}, {b})", "float('inf')")])
    ops = [rng.choice(OPS) for _ in range(rng.randint(1, 6))]
    name = f"triton_red_fused_{red}_{'_'.join(o[0] for o in ops[:3])}_{i}"
    lines = ["@triton.jit",
             f"def {name}(in_ptr0, in_ptr1, out_ptr0, xnumel, rnumel, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):",
             "    xindex = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)[:, None]", "    xmask = xindex < xnumel",
             "    rbase = tl.arange(0, RBLOCK)[None, :]", f"    acc = tl.full([XBLOCK, RBLOCK], {init}, tl.float32)",
             "    for roffset in range(0, rnumel, RBLOCK):", "        rindex = roffset + rbase",
             "        rmask = rindex < rnumel",
             "        x = tl.load(in_ptr0 + (rindex + rnumel * xindex), rmask & xmask, other=0.0).to(tl.float32)",
             "        w = tl.load(in_ptr1 + rindex, rmask, eviction_policy='evict_last', other=0.0).to(tl.float32)"]
    cur = "x"
    for n, (_, expr) in enumerate(ops):
        lines.append(f"        t{n} = {expr.format(a=cur, b='w')}")
        cur = f"t{n}"
    lines += [f"        acc = tl.where(rmask & xmask, {combine.format(a='acc', b=cur)}, acc)",
              f"    tl.store(out_ptr0 + xindex, tl.{red}(acc, 1)[:, None], xmask)"]
    return name, "\n".join(lines), 2


# Inductor's matmul configs for max-autotune, (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps): autotuning
# compiles each matmul shape at every one of them.
MM_CONFIGS = [(32, 32, 16, 1, 2), (32, 32, 128, 2, 4), (32, 64, 32, 5, 8), (64, 32, 32, 5, 8), (64, 32, 128, 5, 4),
              (64, 64, 16, 2, 4), (64, 64, 32, 2, 4), (64, 64, 64, 3, 8), (64, 64, 128, 5, 4), (64, 128, 32, 3, 4),
              (64, 128, 32, 4, 8), (64, 128, 64, 3, 4), (64, 128, 128, 4, 4), (128, 64, 32, 3, 4), (128, 64, 32, 4, 8),
              (128, 128, 32, 2, 8), (128, 128, 32, 3, 4), (128, 128, 64, 3, 4), (128, 128, 64, 5, 8)]
# A transformer's matmuls, forward and backward: tokens (8192), model width (1024), and 3x and 4x the width.
MM_DIMS = (1024, 3072, 4096, 8192)
# Most of a model's matmuls fuse nothing or a bias; a few fuse an activation or a residual.
EPILOGUES = [("", "acc"), ("", "acc"), ("", "acc"), ("addmm", "acc + bias"), ("addmm", "acc + bias"),
             ("relu", "tl.maximum(acc, 0.0)"),
             ("addmm_relu", "tl.maximum(acc + bias, 0.0)"),
             ("addmm_gelu", "(acc + bias) * tl.sigmoid(1.702 * (acc + bias))"),
             ("add", "acc + res"), ("mul_sigmoid", "acc * tl.sigmoid(res)")]


def _matmul(i: int, rng: random.Random) -> tuple[str, str, dict]:
    """Inductor's mm template: grouped launch order, sizes and strides folded in as constants (Inductor bakes
    them into each kernel's source), and a fused epilogue that may load a bias or a residual. The template's
    masked K tail stays in the source; with these sizes every K is a multiple of every BLOCK_K."""
    tag, epilogue = rng.choice(EPILOGUES)
    m, n, k = (rng.choice(MM_DIMS) for _ in range(3))
    name = f"triton_tem_fused_mm_{tag}_{i}" if tag else f"triton_mm_{i}"
    loads = []
    if "bias" in epilogue:
        loads.append("    bias = tl.load(in_ptr0 + idx_n, mask, eviction_policy='evict_last').to(tl.float32)")
    if "res" in epilogue:
        loads.append("    res = tl.load(in_ptr0 + xindex, mask).to(tl.float32)")
    src = f"""@triton.jit
def {name}(in_ptr0, arg_A, arg_B, out_ptr0, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    M = {m}
    N = {n}
    K = {k}
    stride_am = {k}
    stride_ak = 1
    stride_bk = {n}
    stride_bn = 1
    pid = tl.program_id(0)
    grid_m = (M + BLOCK_M - 1) // BLOCK_M
    grid_n = (N + BLOCK_N - 1) // BLOCK_N
    width = GROUP_M * grid_n
    group_id = pid // width
    group_size = min(grid_m - group_id * GROUP_M, GROUP_M)
    pid_m = group_id * GROUP_M + (pid % group_size)
    pid_n = (pid % width) // (group_size)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ram = tl.max_contiguous(tl.multiple_of(rm % M, BLOCK_M), BLOCK_M)
    rbn = tl.max_contiguous(tl.multiple_of(rn % N, BLOCK_N), BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    A = arg_A + (ram[:, None] * stride_am + rk[None, :] * stride_ak)
    B = arg_B + (rk[:, None] * stride_bk + rbn[None, :] * stride_bn)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(K, 0, -BLOCK_K):
        if EVEN_K:
            a = tl.load(A)
            b = tl.load(B)
        else:
            a = tl.load(A, mask=rk[None, :] < k, other=0.)
            b = tl.load(B, mask=rk[:, None] < k, other=0.)
        acc += tl.dot(a, b)
        A += BLOCK_K * stride_ak
        B += BLOCK_K * stride_bk
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    idx_m = rm[:, None]
    idx_n = rn[None, :]
    mask = (idx_m < M) & (idx_n < N)
    xindex = idx_n + N * idx_m
{chr(10).join(loads) if loads else "    pass"}
    acc = {epilogue}
    tl.store(out_ptr0 + tl.broadcast_to(xindex, mask.shape), acc.to(out_ptr0.dtype.element_ty), mask)"""
    return name, src, {"k": k, "dtype": "*bf16"}


BASE32 = "abcdefghijklmnopqrstuvwxyz234567"
# What precedes a kernel in Inductor's module of it (imports, the heuristics decorator and its metadata): its
# ``def`` comes at line 18 or so, where the debug line numbers of every ``.loc`` and ``!DILocation`` count from.
HEADER_LINES = 16


def generate_modules(directory: str, kernels: int, seed: int) -> list[tuple]:
    """Write one module a kernel under ``directory``, named as Inductor names them (``ab/cab...py``: a hash);
    return compile jobs (module path, kernel name, kind, details, variant) for ~``kernels`` groups.

    Half of each target's groups are matmul configurations, as in a real max-autotune cache (413 of the 780
    groups of fixtures/torch-max-autotune-h200-triton36.tpack); the rest are pointwise and reduction kernels.
    One module of all the kernels (the second generator's) gave each kernel lines of its own, numbered into the
    thousands, in every debug location of its IR, unlike Inductor's kernels (the real cache's: 18 to 99)."""
    rng = random.Random(seed)
    per_target = max(1, kernels // 3)
    n_mm = max(1, per_target // 2 // len(MM_CONFIGS))
    rest = max(0, per_target - n_mm * len(MM_CONFIGS))
    n_red = rest // 2 // 2  # 2 configs each
    n_poi = (rest - n_red * 2) // 2  # 2 configs each
    jobs = []
    for kind, count, make, variants in (("poi", n_poi, _pointwise, 2), ("red", n_red, _reduction, 2),
                                        ("mm", n_mm, _matmul, len(MM_CONFIGS))):
        for i in range(count):
            name, src, details = make(i, rng)
            digest = "c" + "".join(rng.choice(BASE32) for _ in range(51))
            path = os.path.join(directory, digest[1:3], f"{digest}.py")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            header = ["import triton", "import triton.language as tl", *["#"] * (HEADER_LINES - 2)]
            with open(path, "w") as f:
                f.write("\n".join([*header, src, ""]))
            jobs += [(path, name, kind, details, v) for v in range(variants)]
    return jobs


def _load(path: str, modules: dict):
    """The module at ``path``, imported once in this process."""
    if path not in modules:
        spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
        modules[path] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[path])
    return modules[path]


def _compile(args) -> int:
    cache_dir, chunk = args
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    targets = [GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)]
    modules: dict = {}
    done = 0
    for path, name, kind, details, variant in chunk:
        fn = getattr(_load(path, modules), name)
        if kind == "poi":
            dtype = ("*fp32", "*fp16")[variant % 2]
            sig = {f"in_ptr{k}": dtype for k in range(details)}
            sig.update({"out_ptr0": "*fp32", "xnumel": "i32", "XBLOCK": "constexpr"})
            consts, options = {"XBLOCK": (1024, 256)[variant]}, {"num_warps": (4, 2)[variant]}
        elif kind == "red":
            sig = {"in_ptr0": ("*fp32", "*bf16")[variant], "in_ptr1": "*fp32", "out_ptr0": "*fp32", "xnumel": "i32",
                   "rnumel": "i32", "XBLOCK": "constexpr", "RBLOCK": "constexpr"}
            consts = {"XBLOCK": (1, 8)[variant], "RBLOCK": (2048, 512)[variant]}
            options = {"num_warps": (8, 4)[variant]}
        else:
            dtype = details["dtype"]
            sig = {"in_ptr0": dtype, "arg_A": dtype, "arg_B": dtype, "out_ptr0": dtype, "GROUP_M": "constexpr",
                   "EVEN_K": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
            bm, bn, bk, stages, warps = MM_CONFIGS[variant]
            consts = {"GROUP_M": 8, "EVEN_K": details["k"] % bk == 0, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
            options = {"num_warps": warps, "num_stages": stages}
        for target in targets:
            src = ASTSource(fn=fn, signature=sig, constexprs=consts)
            triton.compile(src, target=target, options=options)
            done += 1
    return done


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kernels", type=int, default=1200)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    cache_dir = os.path.join(out, "cache")
    jobs = generate_modules(os.path.join(out, "kernels"), args.kernels, args.seed)
    chunks = [jobs[i::args.jobs * 4] for i in range(args.jobs * 4)]
    start = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        total = sum(pool.map(_compile, [(cache_dir, c) for c in chunks]))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache_dir) for f in fs)
    files = sum(len(fs) for _, _, fs in os.walk(cache_dir))
    print(f"compiled {total} kernels into {cache_dir}: {files} files, {size / 1e6:.1f} MB "
          f"in {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
