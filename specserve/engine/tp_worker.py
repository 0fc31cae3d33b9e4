"""A TP worker process: rank r >= 1 of an engine's tensor-parallel group.

    python -m specserve.engine.tp_worker '<json>'

The JSON (built by Engine, see tp_group.WorkerGroup) holds the resolved EngineConfig, the model
path, the rank, the group's init method and distributed backend, and the two ipc addresses of
the step channel. The worker builds the same LocalWorker as rank 0 (runner + speculative worker)
over its shard, then replays every step rank 0 sends: the same StepInput, the same collectives,
the same counter-based sampling, so it produces rank 0's tokens without any token broadcast (its
running digest of them is compared with rank 0's when the group closes).
"""

from __future__ import annotations

import ctypes
import json
import logging
import signal
import sys
import traceback

from specserve.engine.channel import WorkerChannel, unpack

log = logging.getLogger("specserve.tp_worker")

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the engine process (its parent) exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def main(argv: list[str]) -> int:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine stops its workers
    spec = json.loads(argv[0])
    logging.basicConfig(level=spec.get("log_level", "WARNING"),
                        format=f"%(asctime)s tp-rank{spec['rank']} %(levelname)s %(message)s")
    channel = WorkerChannel(spec["rank"], spec["inbox"], spec["reports"])
    try:
        return _serve(spec, channel)
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then exit non-zero
        message = "".join(traceback.format_exception_only(type(e), e)).strip()
        log.error("rank %d failed:\n%s", spec["rank"], traceback.format_exc())
        channel.report(b"error", message=message[:2000])
        return 1
    finally:
        channel.close()


def _serve(spec: dict, channel: WorkerChannel) -> int:
    import os

    import torch

    from specserve.config import config_from_dict
    from specserve.distributed import parallel_state
    from specserve.engine.executor import token_digest
    from specserve.engine.local_worker import build_local_worker
    from specserve.worker.step_input import StepInput

    channel.report(b"ready", stage="started", pid=os.getpid())
    config = config_from_dict(spec["config"])
    if spec.get("cpu_threads"):
        torch.set_num_threads(spec["cpu_threads"])
    parallel_state.init_distributed(config.parallel.tp_size, spec["rank"], spec["backend"],
                                    spec["init_method"])
    try:
        worker = build_local_worker(config, spec["model_path"])
        channel.report(b"ready", stage="loaded", num_pages=worker.runner.num_pages)
        digest, steps = 0, 0
        while True:
            kind, payload = channel.recv()
            if kind == b"step":
                out = worker.execute(StepInput.decode(payload))
                digest = token_digest(digest, out.token_ids)
                steps += 1
            elif kind == b"control":
                msg = unpack(payload)
                worker.control(msg.pop("op"), **msg)
            elif kind == b"close":
                break
            else:
                raise RuntimeError(f"unknown message kind {kind!r} on the step channel")
        worker.close()
        channel.report(b"bye", digest=digest, steps=steps)
        return 0
    finally:
        parallel_state.destroy()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
