"""Generate a large, realistic Triton cache from real compiles, no GPU needed.

Inductor-like kernels: fused pointwise chains (`triton_poi_fused_*`), row reductions (`triton_red_fused_*`) and
tiled matmuls with several block/warp/stage configs, each compiled for cuda:80, cuda:90 and hip:gfx942. The kernel
sources are generated into a module file (Triton reads a kernel's source through inspect), deterministic per seed.
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
    inputs = rng.randint(1, 4)
    ops = [rng.choice(OPS) for _ in range(rng.randint(2, 7))]
    name = f"triton_poi_fused_{'_'.join(o[0] for o in ops[:4])}_{i}"
    args = ", ".join(f"in_ptr{k}" for k in range(inputs))
    lines = ["@triton.jit", f"def {name}({args}, out_ptr0, xnumel, XBLOCK: tl.constexpr):",
             "    xoffset = tl.program_id(0) * XBLOCK", "    xindex = xoffset + tl.arange(0, XBLOCK)",
             "    xmask = xindex < xnumel"]
    for k in range(inputs):
        lines.append(f"    tmp{k} = tl.load(in_ptr{k} + xindex, xmask).to(tl.float32)")
    cur = "tmp0"
    for n, (_, expr) in enumerate(ops):
        other = f"tmp{rng.randrange(inputs)}"
        lines.append(f"    t{n} = {expr.format(a=cur, b=other)}")
        cur = f"t{n}"
    lines.append(f"    tl.store(out_ptr0 + xindex, {cur}, xmask)")
    return name, "\n".join(lines), inputs


def _reduction(i: int, rng: random.Random) -> tuple[str, str, int]:
    red = rng.choice(["sum", "max", "min"])
    ops = [rng.choice(OPS[4:]) for _ in range(rng.randint(1, 4))]
    name = f"triton_red_fused_{red}_{'_'.join(o[0] for o in ops[:3])}_{i}"
    lines = ["@triton.jit", f"def {name}(in_ptr0, out_ptr0, rnumel, RBLOCK: tl.constexpr):",
             "    row = tl.program_id(0)", "    rindex = tl.arange(0, RBLOCK)", "    rmask = rindex < rnumel",
             "    x = tl.load(in_ptr0 + row * rnumel + rindex, rmask, other=0.0).to(tl.float32)"]
    cur = "x"
    for n, (_, expr) in enumerate(ops):
        lines.append(f"    t{n} = {expr.format(a=cur, b='x')}")
        cur = f"t{n}"
    lines.append(f"    tl.store(out_ptr0 + row, tl.{red}({cur}, axis=0))")
    return name, "\n".join(lines), 1


def _matmul(i: int, rng: random.Random) -> tuple[str, str, int]:
    epilogue = rng.choice(["acc", "tl.maximum(acc, 0.0)", "acc * 0.5", "tl.sigmoid(acc)", "acc + 1.0"])
    name = f"triton_tem_fused_mm_{i}"
    src = f"""@triton.jit
def {name}(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a = a_ptr + rm[:, None] * K + rk[None, :]
    b = b_ptr + rk[:, None] * N + rn[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BLOCK_K)):
        acc += tl.dot(tl.load(a), tl.load(b))
        a += BLOCK_K
        b += BLOCK_K * N
    acc = {epilogue}
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.float16))"""
    return name, src, 0


def generate_module(path: str, kernels: int, seed: int) -> list[tuple]:
    """Write the kernel module; return compile jobs (kernel name, kind, inputs, variant) for ~``kernels`` groups."""
    rng = random.Random(seed)
    per_target = max(1, kernels // 3)
    n_mm = per_target // 4 // 4  # 4 configs each: a quarter of the groups
    n_red = per_target // 4 // 2  # 2 configs each
    n_poi = (per_target - n_mm * 4 - n_red * 2) // 2  # 2 configs each
    parts = ["import triton", "import triton.language as tl", ""]
    jobs = []
    for kind, count, make, variants in (("poi", n_poi, _pointwise, 2), ("red", n_red, _reduction, 2),
                                        ("mm", n_mm, _matmul, 4)):
        for i in range(count):
            name, src, inputs = make(i, rng)
            parts += [src, ""]
            jobs += [(name, kind, inputs, v) for v in range(variants)]
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return jobs


def _compile(args) -> int:
    module_path, cache_dir, chunk = args
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = importlib.util.spec_from_file_location("tp_generated_kernels", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    targets = [GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)]
    done = 0
    for name, kind, inputs, variant in chunk:
        fn = getattr(module, name)
        if kind == "poi":
            dtype = ("*fp32", "*fp16")[variant % 2]
            sig = {f"in_ptr{k}": dtype for k in range(inputs)}
            sig.update({"out_ptr0": "*fp32", "xnumel": "i32", "XBLOCK": "constexpr"})
            consts, options = {"XBLOCK": (1024, 256)[variant]}, {"num_warps": (4, 2)[variant]}
        elif kind == "red":
            sig = {"in_ptr0": "*fp32", "out_ptr0": "*fp32", "rnumel": "i32", "RBLOCK": "constexpr"}
            consts, options = {"RBLOCK": (1024, 2048)[variant]}, {"num_warps": (4, 8)[variant]}
        else:
            sig = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32",
                   "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
            bm, bn, bk, warps, stages = [(64, 64, 32, 4, 3), (128, 64, 32, 4, 4), (128, 128, 64, 8, 3),
                                         (64, 128, 64, 4, 4)][variant]
            consts, options = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, {"num_warps": warps,
                                                                              "num_stages": stages}
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
    module_path = os.path.join(out, "tp_generated_kernels.py")
    jobs = generate_module(module_path, args.kernels, args.seed)
    chunks = [jobs[i::args.jobs * 4] for i in range(args.jobs * 4)]
    start = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        total = sum(pool.map(_compile, [(module_path, cache_dir, c) for c in chunks]))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache_dir) for f in fs)
    files = sum(len(fs) for _, _, fs in os.walk(cache_dir))
    print(f"compiled {total} kernels into {cache_dir}: {files} files, {size / 1e6:.1f} MB "
          f"in {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
