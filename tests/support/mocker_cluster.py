"""A frontend and mocker workers, each its own process, over the embedded planes (file
discovery, tcp, zmq KV events): the migration and chaos tests kill workers and start others."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.metrics import metric
from tests.support.processes import DYNGRAPH, ServerProcess, WorkerProcess, embedded_planes_env
from tests.support.routing import instances
from tests.support.waiting import wait_for

ENDPOINT = "dyn://mig.mocker.generate"


def mocker_args(tmp_path: Path, speedup: float) -> Path:
    """Mocker settings: ~5.7 ms of simulated decode per pass, divided by `speedup`."""
    path = tmp_path / f"mocker-{speedup:g}.json"
    path.write_text(json.dumps({"block_size": 16, "speedup_ratio": speedup, "num_gpu_blocks": 8192}))
    return path


@dataclass
class Cluster:
    """A frontend and mocker workers; workers can be killed and replaced."""

    tmp_path: Path
    model_path: Path
    env: dict[str, str]
    args_file: Path
    frontend: ServerProcess
    workers: list[WorkerProcess] = field(default_factory=list)
    retired: list[WorkerProcess] = field(default_factory=list)

    @property
    def model(self) -> str:
        return self.model_path.name

    def start_worker(
        self, env: dict[str, str] | None = None, extra_args: list[str] | None = None
    ) -> WorkerProcess:
        argv = [
            *DYNGRAPH,
            "run",
            f"in={ENDPOINT}",
            "out=mocker",
            str(self.model_path),
            "--extra-engine-args",
            str(self.args_file),
            *(extra_args or []),
        ]
        worker = WorkerProcess(argv, env={**self.env, **(env or {})}, log_dir=self.tmp_path)
        self.workers.append(worker)
        return worker

    def routable(self) -> list[str]:
        return [i["instance_id"] for i in instances(self.frontend, self.model)]

    def wait_routable(self, n: int, timeout: float = 60.0) -> None:
        wait_for(lambda: len(self.routable()) >= n, timeout, f"{n} routable mocker workers")

    def sent(self) -> dict[str, int]:
        return {i["instance_id"]: i["requests"] for i in instances(self.frontend, self.model)}

    def worker_by_instance(self, instance: str) -> WorkerProcess:
        for worker in self.workers:
            if worker.instance() == instance:
                return worker
        raise KeyError(instance)

    def kill9(self, worker: WorkerProcess) -> None:
        worker.kill9()
        self.workers.remove(worker)
        self.retired.append(worker)

    def migrations(self) -> int:
        return int(metric(self.frontend, "dynamo_frontend_model_migration_total"))

    def stop(self) -> None:
        self.frontend.stop()
        for worker in [*self.workers, *self.retired]:
            worker.stop()


def start_cluster(
    tmp_path: Path,
    model_path: Path,
    *,
    workers: int,
    limit: int | None,
    router: str = "round-robin",
    speedup: float = 0.25,
    frontend_env: dict[str, str] | None = None,
    frontend_args: list[str] | None = None,
) -> Cluster:
    """A frontend (`--migration-limit limit`, none if None; more flags: `frontend_args`) and
    `workers` mocker workers, routable."""
    env = embedded_planes_env(tmp_path, zmq_events=True)
    args = ["out=auto", "--router-mode", router, *(frontend_args or [])]
    if limit is not None:
        args += ["--migration-limit", str(limit)]
    frontend = ServerProcess(args, env={**env, **(frontend_env or {})}, log_dir=tmp_path)
    cluster = Cluster(tmp_path, model_path, env, mocker_args(tmp_path, speedup), frontend)
    try:
        frontend.wait_ready(path="/live", timeout=60)
        for _ in range(workers):
            cluster.start_worker()
        cluster.wait_routable(workers)
    except BaseException:
        cluster.stop()
        raise
    return cluster
