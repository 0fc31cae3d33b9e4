"""Count the SASS instructions of a kernel's main loop, compiled for a GPU on a machine without
one: how much work a thread issues per K step (the quantized GEMMs' decode, the MoE's
activation quantization), before a GPU measures the speed.

Each case launches one of our kernels in compile-only mode (tests/triton_compile.py: the
launch is built for sm_<arch> down to a cubin and not run), disassembles the cubin with the
nvdisasm that Triton ships, finds the longest backward branch (the K loop) and counts its
instructions by opcode:

    python scripts/sass_loop.py                       # every case, sm_90
    python scripts/sass_loop.py w4a16-g128-m16 fp8-m1 --arch 90 --top 12

A count is per thread and per loop iteration (one BLOCK_K step), so compare cases with the
same tiles; quarter-rate instructions (I2F, F2F, MUFU) cost more issue slots than one. Each
line also gives the kernel's registers a thread, spilled bytes (LOCAL) and shared memory a
block (cuobjdump's resource usage; Triton's dynamic shared memory from its metadata): what
bounds the blocks an SM holds, hence the loads in flight.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

K, N = 4096, 6144  # Llama-3.1-8B's qkv projection


def _w4(m: int, group: int, fp4: bool, plan: tuple | None = None):  # noqa: ANN202
    def run() -> None:
        import torch

        from specserve.kernels import w4a16_gemm

        sc = torch.ones(N, K // group)
        w4a16_gemm.w4a16_mm(torch.zeros(m, K, dtype=torch.bfloat16),
                            torch.zeros(N, K // 8, dtype=torch.int32),
                            sc.to(torch.float8_e4m3fn) if fp4 else sc.bfloat16(), group, fp4,
                            torch.ones(N) if fp4 else None, plan)  # fmt: skip
    return run


def _fp8(m: int):  # noqa: ANN202
    def run() -> None:
        import torch

        from specserve.kernels import fp8_gemm

        fp8_gemm.fp8_linear(torch.zeros(m, K, dtype=torch.bfloat16),
                            torch.zeros(N, K, dtype=torch.float8_e4m3fn),
                            torch.ones(N // 128, K // 128), 128, 128, 128)  # fmt: skip
    return run


def _moe(fmt: str, tokens: int, block_m: int = 0):  # noqa: ANN202
    def run() -> None:
        import test_fused_moe as t
        import torch

        from specserve.kernels import fused_moe as fm

        t._poison_allocator = lambda *a: None
        launch = (fm.MoELaunch(block_m, 64, 128, 1, 4, 3),) * 2 if block_m else None
        t.check_quant_fused_moe(fmt, tokens, 64, 8, 1024, 256, torch.bfloat16, "cpu", 1.0,
                                launch=launch)
    return run


def _exact(m: int):  # noqa: ANN202
    def run() -> None:
        import torch

        from specserve.kernels import exact_gemm

        exact_gemm.exact_gemm(torch.zeros(m, K, dtype=torch.bfloat16),
                              torch.zeros(N, K, dtype=torch.bfloat16))  # fmt: skip
    return run


def _dense(m: int, plan: tuple):  # noqa: ANN202
    def run() -> None:
        import torch

        from specserve.kernels import dense_gemm
        from specserve.kernels.gemm_split import GemmPlan

        dense_gemm.dense_gemm(torch.zeros(m, K, dtype=torch.bfloat16),
                              torch.zeros(N, K, dtype=torch.bfloat16), None, GemmPlan(*plan))
    return run


CASES = {
    "w4a16-g128-m16": _w4(16, 128, False), "w4a16-g128-m64": _w4(64, 128, False),
    "w4a16-g32-m16": _w4(16, 32, False), "nvfp4-m16": _w4(16, 16, True), "nvfp4-m64": _w4(64, 16, True),
    "w4a16-g128-m1": _w4(1, 128, False, (16, 64, 128, 4, 4, 3)),
    "w4a16-g128-gemv-m1": _w4(1, 128, False, (1, 64, 128, 4, 4, 3)),
    "nvfp4-gemv-m1": _w4(1, 16, True, (1, 64, 128, 4, 4, 3)),
    "w4a16-g128-gemv-m1-wide": _w4(1, 128, False, (1, 128, 256, 8, 2, 3)),
    "w4a16-g128-gemv-m4": _w4(4, 128, False, (4, 64, 128, 4, 4, 3)),
    "w4a16-g128-m4": _w4(4, 128, False, (16, 64, 128, 4, 4, 3)),
    "fp8-m1": _fp8(1), "fp8-m16": _fp8(16), "fp8-m64": _fp8(64),
    "moe-int4-g32-decode": _moe("ct-int4-g32", 1), "moe-fp8-decode": _moe("fp8-block", 1),
    "moe-int4-g32-gemv": _moe("ct-int4-g32", 1, 1),
    "exact-m1": _exact(1),
    "dense-gemv-m1": _dense(1, (1, 64, 128, 4, 4, 3)), "dense-m16": _dense(16, (16, 64, 128, 4, 4, 4)),
}  # fmt: skip


def loop_counts(cubin: bytes, nvdisasm: str) -> collections.Counter:
    """Opcode counts of the longest loop (label .. backward branch to it) of a cubin's SASS."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"sass_loop_{os.getpid()}.cubin"
    path.write_bytes(cubin)
    lines = subprocess.run([nvdisasm, "-c", str(path)], capture_output=True, text=True,
                           check=True).stdout.splitlines()  # fmt: skip
    path.unlink()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"^\.(L_x_\d+):", line.strip()))}  # fmt: skip
    best = (0, 0, 0)
    for i, line in enumerate(lines):
        m = re.search(r"\bBRA\b.*?`\(\.(L_x_\d+)\)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            best = max(best, (i - labels[m.group(1)], labels[m.group(1)], i))
    ops: collections.Counter = collections.Counter()
    for line in lines[best[1] : best[2] + 1]:
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def resources(cubin: bytes, cuobjdump: str) -> dict[str, int]:
    """REG (a thread), LOCAL (spill bytes a thread) and static SHARED of a cubin's kernel."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"sass_res_{os.getpid()}.cubin"
    path.write_bytes(cubin)
    out = subprocess.run([cuobjdump, "--dump-resource-usage", str(path)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    path.unlink()
    found = dict(re.findall(r"\b(REG|LOCAL|SHARED):(\d+)", out))
    return {key: int(value) for key, value in found.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="*", help=f"any of {', '.join(CASES)} (default: all)")
    p.add_argument("--arch", default="90")
    p.add_argument("--top", type=int, default=10, help="opcodes listed per kernel")
    args = p.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    os.environ["SPECSERVE_TRITON_COMPILE_ONLY"] = args.arch
    import triton
    import triton_compile
    from triton.runtime.jit import JITFunction

    triton_compile._install(args.arch)
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    nvdisasm, cuobjdump = str(bin_dir / "nvdisasm"), str(bin_dir / "cuobjdump")
    launched: list = []
    compile_only = JITFunction.run

    def grab(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        kernel = compile_only(self, *a, **kw)
        launched.append((self.fn.__name__, kernel))
        return kernel

    JITFunction.run = grab
    report = {}
    for name in args.cases or CASES:
        launched.clear()
        try:
            CASES[name]()
        except Exception as err:  # noqa: BLE001  (outputs are never written: value checks fail)
            if not launched:  # nothing compiled: say why instead of printing nothing
                cause = err.__cause__ or err
                print(f"{name:22s} did not compile: {type(cause).__name__}: "
                      f"{str(cause).strip().splitlines()[-1][:200]}", flush=True)
        for kernel_name, kernel in launched:
            if kernel_name.startswith("_quant"):
                continue  # the activation quantization launch: no K loop
            ops = loop_counts(kernel.asm["cubin"], nvdisasm)
            res = resources(kernel.asm["cubin"], cuobjdump)
            res["SHARED"] = res.get("SHARED", 0) + kernel.metadata.shared
            report[f"{name} {kernel_name}"] = {**dict(ops), "resources": res}
            top = ", ".join(f"{op} {n}" for op, n in ops.most_common(args.top))
            print(f"{name:22s} {kernel_name:22s} {sum(ops.values()):5d}  reg {res.get('REG')} "
                  f"spill {res.get('LOCAL')} smem {res['SHARED'] // 1024}K  {top}", flush=True)
    return report


if __name__ == "__main__":
    main()
