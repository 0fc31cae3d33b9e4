"""Which kernel launches compile for which GPU architectures, on a machine without a GPU.

    python scripts/compile_targets.py [--archs 80,89,90,100,120] [--files F,...] [--json-out FILE]

Runs every kernel check file of tests/test_triton_compile.py in compile-only mode
(tests/triton_compile.py: each launch built to a cubin with Triton's own ptxas and held to the
architecture's shared memory) for each architecture, printing a line per file as it goes and
then, per architecture, the checks that did not compile with the first line of the reason.
The suite checks sm_90 and sm_120 on every run; this is the wider matrix (Ampere, Ada, B200).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

from test_triton_compile import KERNEL_FILES, NO_LAUNCH  # noqa: E402
from triton_compile import ARCHS, run_compiled  # noqa: E402


def reason(text: str) -> str:
    """The compile failure's own line (Triton's error), else the first line."""
    lines = [line for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "needs" in line:
            return line.strip()[:200]
    return lines[0][:200] if lines else "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", default=",".join(ARCHS),
                    help=f"compute capabilities without the dot, of {', '.join(ARCHS)}")
    ap.add_argument("--files", default=",".join(KERNEL_FILES),
                    help="kernel check files under tests/ (default: all of them)")
    ap.add_argument("--json-out", help="write {arch: {file:check: 'ok' or why}} here")
    args = ap.parse_args(argv)
    archs, files = args.archs.split(","), args.files.split(",")
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        ap.error(f"--archs: unknown {', '.join(unknown)}; choose from {', '.join(ARCHS)}")
    unknown = [f for f in files if f not in KERNEL_FILES]
    if unknown:
        ap.error(f"--files: unknown {', '.join(unknown)}; choose from {', '.join(KERNEL_FILES)}")
    results: dict[str, dict[str, str]] = {}
    for arch in archs:
        results[arch] = {}
        for name in files:
            t0 = time.perf_counter()
            got = run_compiled(str(TESTS / name), arch)
            results[arch].update({f"{name}:{k}": v for k, v in got.items()})
            bad = sum(v != "ok" and k not in NO_LAUNCH for k, v in got.items())
            print(f"sm_{arch} {name:<26} {len(got) - bad:>3}/{len(got)} compiled "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print()
    for arch, got in results.items():
        failed = {k: v for k, v in got.items() if v != "ok" and k.split(":")[1] not in NO_LAUNCH}
        print(f"sm_{arch}: {len(got) - len(failed)}/{len(got)} checks compile")
        for check, why in failed.items():
            print(f"  {check}: {reason(why)}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
