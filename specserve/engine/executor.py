"""Executor: runs every engine step on all TP ranks.

Rank 0 is this process's LocalWorker; with tp_size > 1 ranks 1 .. tp_size-1 are worker
processes (engine/tp_group.py). A step is one message: the StepInput's msgpack bytes go to
every worker before rank 0 runs it, so all ranks enter the step's collectives together.
Workers answer nothing per step: sampling is counter-based (seed, position), so every rank
samples the same tokens from the same (all-reduced) logits, and the next StepInput carries
what the scheduler made of them. Each rank keeps a running digest of the tokens it produced;
`close()` returns the workers' digests, to be compared with `digest` (rank 0's).
"""

from __future__ import annotations

import logging
import socket
import zlib
from typing import TYPE_CHECKING, Any

from specserve.config import EngineConfig, config_to_dict
from specserve.distributed import parallel_state
from specserve.engine.errors import EngineDeadError
from specserve.engine.local_worker import LocalWorker, ProposerFactory, build_local_worker
from specserve.worker.step_input import StepInput, StepOutput

if TYPE_CHECKING:  # the TP group (and ZMQ) are imported only when tp_size > 1
    from specserve.engine.tp_group import WorkerGroup

log = logging.getLogger(__name__)


def token_digest(digest: int, token_ids: list[list[int]]) -> int:
    """Running CRC32 over a step's emitted tokens (rows in order, -1 between rows)."""
    flat = [t for row in token_ids for t in (*row, -1)]
    return zlib.crc32(repr(flat).encode(), digest)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distributed_backend(config: EngineConfig) -> str:
    choice = config.parallel.distributed_backend
    if choice != "auto":
        return choice
    import torch

    on_gpu = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    return "nccl" if on_gpu else "gloo"


class Executor:
    def __init__(self, config: EngineConfig, model_path: str | None,
                 proposer: ProposerFactory | None = None) -> None:
        """config: the engine's resolved config. Starts the TP group when tp_size > 1."""
        tp = config.parallel.tp_size
        self.group: WorkerGroup | None = None
        self.digest = 0
        self._closed_digests: dict[int, int] | None = None
        if tp == 1:
            self.local: LocalWorker = build_local_worker(config, model_path, proposer)
            return
        if proposer is not None:
            raise ValueError("a proposer given as a Python object cannot reach the TP workers: "
                             "name it in the speculative config, or run with tp_size 1")
        if parallel_state.get_tp_group() is not None:
            raise ValueError("this process already is a rank of a TP group: close the other "
                             "engine first (one TP engine per process)")
        from specserve.engine.tp_group import WorkerGroup

        backend = distributed_backend(config)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        spec = {"config": config_to_dict(config), "model_path": model_path,
                "backend": backend, "init_method": init_method,
                "cpu_threads": config.cpu_threads,
                "log_level": logging.getLevelName(logging.getLogger("specserve").level)}
        self.group = WorkerGroup(spec, tp, config.parallel.step_timeout_s)
        try:
            self.group.wait_stage("started")
            with self.group.blocking():
                parallel_state.init_distributed(tp, 0, backend, init_method)
                self.local = build_local_worker(config, model_path)
            self.group.wait_stage("loaded")
        except BaseException as e:
            failure = self.group.failure
            self._shutdown()
            if failure is not None:
                raise EngineDeadError(failure) from e
            raise
        log.info("TP group of %d ranks up (%s); workers: pids %s", tp, backend,
                 self.group.pids)

    @property
    def runner(self):
        return self.local.runner

    @property
    def drafter(self):
        return self.local.drafter

    @property
    def failure(self) -> str | None:
        """Why the TP group is dead (a worker died or hung), even between steps; else None."""
        return self.group.failure if self.group is not None else None

    @property
    def worker_pids(self) -> list[int]:
        return self.group.pids if self.group is not None else []

    def execute(self, step: StepInput) -> StepOutput:
        if self.group is None:
            return self.local.execute(step)
        self.group.send(b"step", step.encode())
        with self.group.blocking(step=True):
            try:
                out = self.local.execute(step)
            except Exception as e:
                # a collective failing under rank 0 usually means a peer died: give the
                # monitor a moment to say which
                failure = self.group.wait_failure(timeout_s=1.0)
                if failure is not None:
                    raise EngineDeadError(failure) from e
                raise
        self.group.check()
        self.digest = token_digest(self.digest, out.token_ids)
        return out

    def control(self, op: str, **args: Any) -> Any:
        """Apply op on every rank; rank 0's answer."""
        if self.group is not None:
            from specserve.engine.channel import pack

            self.group.send(b"control", pack({"op": op, **args}))
            with self.group.blocking():  # start-up work (profiling), not timed as a step
                out = self.local.control(op, **args)
            self.group.check()
            return out
        return self.local.control(op, **args)

    def close(self) -> dict[int, int]:
        """Stop the workers; {rank: digest of the tokens it produced} (empty at TP 1)."""
        if self._closed_digests is None:
            self._closed_digests = self._shutdown()
        return self._closed_digests

    def _shutdown(self) -> dict[int, int]:
        digests: dict[int, int] = {}
        if self.group is not None:
            byes = self.group.close()
            digests = {rank: msg["digest"] for rank, msg in byes.items()}
            parallel_state.destroy()
        if getattr(self, "local", None) is not None:
            self.local.close()
        return digests
