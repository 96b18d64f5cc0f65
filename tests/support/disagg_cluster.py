"""Disaggregated prefill/decode deployments for the system tests: a frontend with kv routing,
prefill workers that hand a prompt's KV over and decode workers that fetch it, each its own
process over the embedded planes (mocker workers by default; llama.cpp and vLLM too)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.metrics import metric
from tests.support.processes import ServerProcess, WorkerProcess, embedded_planes_env
from tests.support.waiting import wait_for

LONG = "The quarterly report covers revenue, costs, hiring, the new office and the roadmap. " * 6


@dataclass
class DisaggCluster:
    """A frontend with kv routing, prefill workers and decode workers."""

    tmp_path: Path
    model_path: Path
    env: dict[str, str]
    args_file: Path
    frontend: ServerProcess
    engine: str = "mocker"
    prefill: list[WorkerProcess] = field(default_factory=list)
    decode: list[WorkerProcess] = field(default_factory=list)

    @property
    def model(self) -> str:
        return self.model_path.name

    def start_worker(
        self, mode: str, engine: str | None = None, *flags: str, env: dict[str, str] | None = None
    ) -> WorkerProcess:
        """A prefill or decode worker of `engine` (default the cluster's), with more `flags`."""
        component = "prefill" if mode == "prefill" else "backend"
        worker = WorkerProcess.dyngraph(
            [
                f"in=dyn://pd.{component}.generate",
                f"out={engine or self.engine}",
                str(self.model_path),
                "--extra-engine-args",
                str(self.args_file),
                "--disaggregation-mode",
                mode,
                *flags,
            ],
            env={**self.env, **(env or {})},
            log_dir=self.tmp_path,
            name=mode,
        )
        (self.prefill if mode == "prefill" else self.decode).append(worker)
        return worker

    def health(self) -> dict[str, Any]:
        details = httpx.get(f"{self.frontend.base_url}/health", timeout=5).json().get("details", {})
        return details.get(self.model) or {}

    def sent(self, pool: str) -> dict[str, int]:
        return {i["instance_id"]: i["requests"] for i in self.health().get(pool, [])}

    def wait_pools(self, prefill: int, decode: int, timeout: float = 60.0) -> None:
        wait_for(
            lambda: len(self.sent("prefill_instances")) >= prefill and len(self.sent("instances")) >= decode,
            timeout,
            f"{prefill} prefill and {decode} decode workers routable",
        )

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.frontend, name, **labels)

    def stop(self) -> None:
        self.frontend.stop()
        for worker in [*self.prefill, *self.decode]:
            worker.stop()


def start_disagg(
    tmp_path: Path,
    model_path: Path,
    *,
    prefill: int,
    decode: int,
    frontend_args: tuple[str, ...] = (),
    speedup: float = 4.0,
    prefill_env: dict[str, str] | None = None,
    engine: str = "mocker",
    engine_args: dict[str, Any] | None = None,
) -> DisaggCluster:
    """A frontend and `prefill` + `decode` workers of `engine` (mocker: with `speedup`)."""
    env = embedded_planes_env(tmp_path, zmq_events=True)
    args_file = tmp_path / f"{engine}.json"
    if engine_args is None:
        engine_args = {"block_size": 16, "speedup_ratio": speedup, "num_gpu_blocks": 4096}
    args_file.write_text(json.dumps(engine_args))
    frontend = ServerProcess(
        ["out=auto", "--router-mode", "kv", "--migration-limit", "3", *frontend_args],
        env=env,
        log_dir=tmp_path,
    )
    cluster = DisaggCluster(tmp_path, model_path, env, args_file, frontend, engine)
    try:
        frontend.wait_ready(path="/live", timeout=60)
        for _ in range(prefill):
            cluster.start_worker("prefill", env=prefill_env)
        for _ in range(decode):
            cluster.start_worker("decode")
        cluster.wait_pools(prefill, decode)
    except BaseException:
        cluster.stop()
        raise
    return cluster
