"""Compile-only checks: every Triton launch of a kernel check file is built for a CUDA
architecture (TTIR -> PTX -> cubin through Triton's own ptxas) on a machine without a GPU, and
nothing runs. A kernel that only the interpreter accepts (a non-constexpr module global, a
shape rule the interpreter does not enforce, an op the architecture lacks) fails here, on the
CPU, instead of at the first GPU run.

`run_compiled(test_file, arch)` runs `python test_file` with SPECSERVE_TRITON_COMPILE_ONLY=arch;
the file's `report(checks)` (tests/interpreted.py) then calls `compile_checks(checks)`: each
check runs as under the interpreter, but each launch only compiles. Outputs are never written,
so whatever a check asserts about values after a launch fails and is ignored; what counts is
that no launch failed to compile and that the check reached at least one launch.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from specserve.kernels.dispatch import COMPILE_ONLY_ENV

REPO = Path(__file__).resolve().parents[1]
# per architecture: (SMs of a typical part, bytes of shared memory one block may use)
ARCHS = {
    "80": (108, 166912),  # A100
    "89": (128, 101376),  # L40S
    "90": (132, 232448),  # H100 / H200
    "100": (148, 232448),  # B200
    "120": (188, 101376),  # RTX PRO 6000 Blackwell
}


class CompileFailure(RuntimeError):
    """A launch whose kernel did not compile for the target."""


def run_compiled(test_file: str, arch: str = "90", timeout: int = 1200) -> dict[str, str]:
    """Run `python test_file` in compile-only mode for sm_<arch>: {check: "ok" or why}."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, COMPILE_ONLY_ENV: arch, "PYTHONPATH": path}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, test_file], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1])


def _install(arch: str) -> list[str]:
    """Make Triton target sm_<arch> with no GPU present and turn every launch into a compile.
    Returns the list that each compiled launch appends its kernel's name to."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    capability = int(arch)
    sms, shared_limit = ARCHS[arch]

    class CompileOnlyDriver:
        """What JITFunction.run asks of the active driver, for a GPU that is not there."""

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", capability, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

    driver.set_active(CompileOnlyDriver())
    compiled: list[str] = []
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        try:
            kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as exc:
            raise CompileFailure(f"{self.fn.__name__} does not compile for sm_{arch}") from exc
        if kernel.metadata.shared > shared_limit:  # the driver would refuse it at launch
            raise CompileFailure(
                f"{self.fn.__name__} needs {kernel.metadata.shared} bytes of shared memory; "
                f"sm_{arch} gives a block at most {shared_limit}"
            )
        compiled.append(self.fn.__name__)
        return kernel

    JITFunction.run = compile_only
    # every kernel module now, so that each @jit function is a compilable JITFunction
    import specserve.kernels as kernels

    for mod in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"specserve.kernels.{mod.name}")
    # launch plans (KV splits, GEMM K splits, tiles) sized for the target's SMs and shared
    # memory, as on the GPU
    from specserve.kernels import gemm_split, split_kv

    gemm_split.num_sms = lambda device: sms
    gemm_split.max_shared_memory = lambda device: shared_limit
    gemm_split.fp8_native = lambda device: capability >= 89
    split_kv._num_sms = lambda device: sms
    return compiled


def compile_checks(checks: dict[str, Callable[[], None]]) -> dict[str, str]:
    """Run each check with compile-only launches: "ok" when its launches compiled (at least
    one), else the compile error or what stopped the check before any launch."""
    compiled = _install(os.environ[COMPILE_ONLY_ENV])
    results = {}
    for name, check in checks.items():
        before = len(compiled)
        stopped = None
        try:
            check()
        except Exception as exc:
            cause: BaseException | None = exc
            while cause is not None and not isinstance(cause, CompileFailure):
                cause = cause.__cause__ or cause.__context__
            if cause is not None:
                root = cause.__cause__ or cause
                why = "".join(traceback.format_exception_only(root)).strip()
                results[name] = f"{cause}: {why[-3000:]}"
                continue
            stopped = traceback.format_exc(limit=3)  # a value check on unwritten outputs
        kernels = sorted(set(compiled[before:]))
        if kernels:
            results[name] = "ok"
        else:
            results[name] = f"no launch reached\n{stopped or ''}"
    variants = len(compiled)
    print(f"compiled {variants} launches of {len(set(compiled))} kernels: "
          f"{', '.join(sorted(set(compiled)))}", file=sys.stderr)
    return results
