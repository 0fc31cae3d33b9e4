"""Replay the failures of issue 18 against a live `specserve serve` on the bundled model.

    python scripts/red_team.py [--json-out FILE] [--keep-logs DIR]

Starts the server on 127.0.0.1 only (twice: the stuck-engine case ends its server, by design),
replays every case with bounded counts and deadlines, prints one row per case (what was filed
before the fix, what is observed now, whether that is the documented behaviour) and exits 1 if
any case fails. The server process carries two fault hooks, armed only by prompts holding
RED-TEAM-STALL (one engine step hangs) or RED-TEAM-SLOW (each step takes 60 ms): the only way
to make a healthy engine hang, or outlast a drain, from outside.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from red_team_cases import (  # noqa: E402
    Case,
    Ctx,
    chat_default_max_tokens,
    duplicate_auth,
    echoed_input,
    engines_in_a_row,
    gauges_after_response,
    huge_prompt,
    key_handling,
    many_messages,
    seeded_under_preemption,
    slash_redirect,
    stop_token_flood,
    tiny_temperatures,
)
from red_team_faults import (  # noqa: E402
    connection_flood,
    sigterm_past_drain,
    slow_body,
    slowloris,
    stalled_uploads,
    stuck_engine,
)

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-red-team"
HOOKS = r"""
import sys, time
from specserve.engine import engine as E
from specserve.cli import main
add, step, marked = E.Engine.add_request, E.Engine.step, {}
def hooked_add(self, rid, prompt, params=None):
    text = self.tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
    rid = add(self, rid, prompt, params)
    for mark in ("RED-TEAM-STALL", "RED-TEAM-SLOW"):
        if mark in text:
            marked[rid] = mark
    return rid
def hooked_step(self):
    live = {m for r, m in list(marked.items()) if self.get_request(r) is not None}
    if "RED-TEAM-STALL" in live and not getattr(self, "stalled", False):
        self.stalled = True
        time.sleep(4.0)
    elif "RED-TEAM-SLOW" in live:
        time.sleep(0.06)
    return step(self)
E.Engine.add_request, E.Engine.step = hooked_add, hooked_step
sys.exit(main(sys.argv[1:]))
"""


# item, case, before the fix (as filed in the issue), check; the two that end a server last
CASES = [
    Case(
        1,
        "tiny temperatures",
        "T=1e-38..1e-40: NaN logits, one token repeated; T=1e-46: sampled at T=1",
        tiny_temperatures,
    ),
    Case(2, "7.9 MB prompt", "froze /health and every request for 31 s", huge_prompt),
    Case(2, "200k chat messages", "froze the server for 4 s", many_messages),
    Case(3, "stalled uploads", "100 uploads one byte short held +775 MB forever", stalled_uploads),
    Case(3, "slowloris headers", "never closed", slowloris),
    Case(3, "slow body", "never closed", slow_body),
    Case(3, "connection flood", "no connection cap", connection_flood),
    Case(
        4,
        "1.3M stop_token_ids",
        "accepted, scanned every token (others 3x slower)",
        stop_token_flood,
    ),
    Case(5, "7.3 MB field echoed", "a 7.3 MB error body", echoed_input),
    Case(8, "chat, no max_tokens, small pool", "400 'lower max_tokens'", chat_default_max_tokens),
    Case(
        9,
        "seeded sampling under preemption",
        "3 of 4 seeded requests differed",
        seeded_under_preemption,
    ),
    Case(
        10,
        "duplicate Authorization",
        "wrong-then-right passed; 401 type authentication_error",
        duplicate_auth,
    ),
    Case(
        10,
        "API key sources",
        "empty --api-key accepted; key only on the command line; no warning on a public bind",
        key_handling,
    ),
    Case(11, "trailing slash + forged Host", "307 to the forged host", slash_redirect),
    Case(12, "gauges right after a response", "showed pages still in use", gauges_after_response),
    Case(
        13, "5 engines in one process", "the 4th: KV budget 'holds 0 pages' (GPU)", engines_in_a_row
    ),
    Case(
        7,
        "stuck engine (watchdog 1 s)",
        "a 25 s stall kept /health 200; requests hung",
        stuck_engine,
    ),
    Case(
        6,
        "SIGTERM past the drain timeout",
        "streams cut without an error event, "
        "non-streams a plain-text 500; log said 'all requests finished'",
        sigterm_past_drain,
    ),
]


class Server:
    """`specserve serve` (with the fault hooks) in a subprocess on a free loopback port."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "w+")
        cmd = [
            sys.executable,
            "-c",
            HOOKS,
            "--log-level",
            "INFO",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            "cpu",
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        )
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited during start-up:\n{self.text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not come up in 180 s")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def run_case(case, ctx: Ctx, limit_s: float) -> tuple[bool, str, float]:
    """(ok, observed, seconds); a case that raises or overruns its limit fails."""
    result: list = []

    def target() -> None:
        try:
            result.append(case.fn(ctx))
        except Exception as exc:  # the row says what broke
            result.append((False, f"{type(exc).__name__}: {str(exc)[:150]}"))

    t0 = time.monotonic()
    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(limit_s)
    if not result:
        return False, f"no result within {limit_s:.0f} s", time.monotonic() - t0
    ok, observed = result[0]
    return ok, observed, time.monotonic() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--keep-logs", default=None, help="directory for the server logs")
    parser.add_argument("--case-timeout", type=float, default=60.0)
    args = parser.parse_args()
    log_dir = Path(args.keep_logs or tempfile.mkdtemp(prefix="red-team-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    key_file = log_dir / "api-key"
    key_file.write_text(KEY + "\n")
    common = [
        # the bundled tiny code model and its head (fast on a CPU), speculation on
        "--model",
        str(ROOT / "specserve" / "assets" / "tiny-code"),
        "--spec-draft-model",
        str(ROOT / "specserve" / "assets" / "tiny-code-eagle3"),
        "--timeout-header",
        "1",
        "--timeout-body",
        "1.5",
        "--max-connections",
        "40",
        "--drain-timeout",
        "1",
        # the fault hooks patch the Engine class in the server process: keep the engine there
        # (the engine-core process's own faults: tests/test_engine_core_proc.py)
        "--no-engine-process",
    ]
    t0 = time.monotonic()
    # A: small KV pool (preemption, the default max_tokens), key from a file
    main_server = Server(
        "server-a",
        [
            *common,
            "--api-key-file",
            str(key_file),
            "--num-pages",
            "16",
            "--page-size",
            "16",
            "--step-timeout-s",
            "5",
        ],
        {},
        log_dir,
    )
    # B: a short watchdog, key from the environment; the stall case ends it
    stall_server = Server(
        "server-b", [*common, "--step-timeout-s", "1"], {"SPECSERVE_API_KEY": KEY}, log_dir
    )
    ctx = Ctx(main_server, stall_server, KEY, ROOT)
    rows = []
    try:
        for case in CASES:
            ok, observed, seconds = run_case(case, ctx, args.case_timeout)
            rows.append(
                {
                    "item": case.item,
                    "case": case.name,
                    "before": case.before,
                    "now": observed,
                    "ok": ok,
                    "seconds": round(seconds, 2),
                }
            )
            print(
                f"[{'PASS' if ok else 'FAIL'}] {case.item:>3} {case.name} ({seconds:.1f} s)",
                flush=True,
            )
    finally:
        main_server.stop()
        stall_server.stop()
    print(f"\n{len(rows)} cases in {time.monotonic() - t0:.0f} s; server logs in {log_dir}\n")
    print("| item | case | before (as filed) | now (observed) | ok |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['item']} | {r['case']} | {r['before']} | {r['now']} | "
            f"{'yes' if r['ok'] else 'NO'} |"
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    failed = [r["case"] for r in rows if not r["ok"]]
    if failed:
        print(f"\nFAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
