"""dyngraph's frontend beside NVIDIA Dynamo 1.6.1's, in one run on one machine (issue 27).

Each stack is a frontend and its own mocker workers at speedup 10000 (engine time ~0). The
points are issue 27's rows: bench_frontend.py's streamed chat (~70 prompt tokens with the
template, 64 output tokens, one SSE event per token) at c=32 behind round-robin over one worker,
with a new connection per request and with keep-alive; and bench_long_prompts.py's one_message
workload (a 4k-token document and a new question in one user message, 64 tokens out) at c=8
behind kv routing over two workers, new connections. The figure is each frontend process's
CPU-ms per request read from /proc, the stacks taking turns over rounds (`alternate`) so a
shared machine's drift falls on both. On the short points a third stack takes its turns too:
ours with `--stream-interval 4` (four tokens per SSE event; Dynamo has no such option), whose
saving is reported beside, never in, the ratio to Dynamo.

Dynamo runs from its own virtual environment. `pip install ai-dynamo==1.6.1` fails offline (its
`aisimulate` dependency downloads at install time); this works, and the frontend and mocker run
without aisimulate:

    python3 -m venv /tmp/dynvenv
    /tmp/dynvenv/bin/pip install --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
    /tmp/dynvenv/bin/pip install 'aiohttp<4.0,>=3.14.3' certifi 'kubernetes<33.0.0,>=32.0.1' \
        'msgspec>=0.19.0' 'prometheus-client<1.0,>=0.23.1' 'pyzmq>=26.0.0' 'redis<9.0.0,>=6.2.0' \
        'tqdm>=4.0.0' 'transformers>=4.56.0' 'typing-extensions>=4.10.0' 'zstandard<1.0,>=0.23.0' \
        'pydantic>=2.10.6,<=2.13.5' 'uvloop>=0.21.0' jinja2

    python benchmarks/bench_vs_dynamo.py --model .cache/tiny-model --dynamo-python /tmp/dynvenv/bin/python

Results: benchmarks/results/frontend_vs_dynamo.json (with the commit and the machine).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_frontend as bench
from bench_long_prompts import long_body

from dynamo_graph.bench.provenance import git_of, provenance
from dynamo_graph.bench.report import write_json


def for_both(body: dict) -> dict:
    """`body` with `ignore_eos` at the top level: Dynamo 1.6.1's `nvext` refuses it there."""
    return {key: value for key, value in body.items() if key != "nvext"} | {"ignore_eos": True}


BODY = for_both(bench.STREAM_BODY)
_long = long_body(4096, one_message=True)
_questions = itertools.count()


def LONG_BODY(_: int) -> dict:
    """The next request of bench_long_prompts.py's one_message workload: numbered across the
    whole run (`measure` numbers each point's requests from 0), so no question comes twice and
    no stack answers a repeat from a cache of whole prompts."""
    return for_both(_long(next(_questions)))


def dynamo_stack(
    python: str, model: str, scratch: Path, router: str, workers: int
) -> tuple[list[subprocess.Popen], int]:
    """Dynamo's frontend and `workers` mockers on file discovery, the TCP request plane and the
    zmq event plane in `scratch`; (the processes, the frontend first; the frontend's port)."""
    env = {
        **os.environ,
        "DYN_FILE_KV": str(scratch / "discovery"),
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_LOG": "warn",
    }
    planes = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
    port = bench.free_port()
    mocker = [python, "-m", "dynamo.mocker", "--model-path", model, "--model-name", "bench"]
    mocker += ["--speedup-ratio", "10000", *planes]
    mockers = [
        subprocess.Popen(mocker, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(workers)
    ]
    front = [python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port)]
    front += ["--router-mode", router, *planes]
    return [bench.start(front, port, 0.0, env=env), *mockers], port


def dyngraph_stack(
    model: str, scratch: Path, router: str, workers: int, stream_interval: int = 1
) -> tuple[list[subprocess.Popen], int]:
    """Our frontend (`out=auto`, `--stream-interval`) and `workers` mocker workers, on planes in
    `scratch`."""
    scratch.mkdir(parents=True)
    env = bench.embedded_planes(scratch)
    mockers = bench.mocker_workers(model, scratch, env, count=workers, extra=("--context-length", "16384"))
    port = bench.free_port()
    argv = [sys.executable, "-m", "dynamo_graph", "run", "in=http", "out=auto", "--http-port", str(port)]
    argv += ["--router-mode", router, "--stream-interval", str(stream_interval)]
    return [bench.start(argv, port, 0.0, env=env), *mockers], port


def wait_served(port: int, timeout_s: float = 120.0) -> None:
    """Until the frontend streams a whole answer (its worker is discovered)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY, timeout=10)
            if answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]"):
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"frontend on {port} never served a whole stream")


# (name, router mode, workers per stack, concurrency, keep-alive, body): the rows.
POINTS = (
    ("short_c32_new_connections", "round-robin", 1, 32, False, BODY),
    ("short_c32_keep_alive", "round-robin", 1, 32, True, BODY),
    ("one_message_4k_doc_c8_kv", "kv", 2, 8, False, LONG_BODY),
)


def compare(args: argparse.Namespace, scratch: Path, router: str, workers: int, points: list) -> dict:
    """Both stacks up with `router` and `workers`, then each of `points` measured in turns."""
    model = str(Path(args.model).resolve())
    processes: list[subprocess.Popen] = []
    measured = {}
    try:
        ours, our_port = dyngraph_stack(model, scratch / f"dyngraph-{router}", router, workers)
        processes += ours
        theirs, their_port = dynamo_stack(
            args.dynamo_python, model, scratch / f"dynamo-{router}", router, workers
        )
        processes += theirs
        frontends = {"dynamo-1.6.1": (theirs[0], their_port), "dyngraph": (ours[0], our_port)}
        if args.stream_interval > 1 and router == "round-robin":
            # Ours again, N tokens per event: what the option saves (Dynamo has none).
            grouped, grouped_port = dyngraph_stack(
                model, scratch / "dyngraph-interval", router, workers, args.stream_interval
            )
            processes += grouped
            frontends[f"dyngraph-stream-interval-{args.stream_interval}"] = (grouped[0], grouped_port)
        for _, port in frontends.values():
            wait_served(port)
        for name, _, _, concurrency, keep_alive, body in points:
            print(f"--- {name}", flush=True)
            requests = args.requests if concurrency >= 32 else args.requests // 4
            cpu = bench.alternate(
                frontends,
                body,
                args.rounds,
                concurrency=concurrency,
                requests=requests,
                keep_alive=keep_alive,
                max_seconds=args.max_seconds,
            )
            median = {stack: statistics.median(values) for stack, values in cpu.items()}
            ratio = round(median["dyngraph"] / median["dynamo-1.6.1"], 3)
            interval = {
                stack: {
                    "ratio_to_dynamo": round(value / median["dynamo-1.6.1"], 3),
                    "ratio_to_one_token_per_event": round(value / median["dyngraph"], 3),
                }
                for stack, value in median.items()
                if stack.startswith("dyngraph-stream-interval")
            }
            measured[name] = {
                "router": router,
                "workers": workers,
                "concurrency": concurrency,
                "keep_alive": keep_alive,
                "requests": requests,
                "cpu_ms_per_request": cpu,
                "median": median,
                "ratio": ratio,
                **({"stream_interval": interval} if interval else {}),
            }
            print(f"    median {json.dumps(median)}; dyngraph / Dynamo = {ratio}", flush=True)
    finally:
        bench.stop_all(processes)
    return measured


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="the tokenizer folder both serve (the tiny model)")
    parser.add_argument("--dynamo-python", required=True, help="python of a venv with ai-dynamo 1.6.1")
    parser.add_argument("--requests", type=int, default=1500, help="per point at c=32 (a quarter at c=8)")
    parser.add_argument("--max-seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--points", default=",".join(p[0] for p in POINTS))
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=4,
        help="also measure ours at N tokens per SSE event on the short points (1: not)",
    )
    parser.add_argument(
        "--out", type=Path, default=bench.ROOT / "benchmarks" / "results" / "frontend_vs_dynamo.json"
    )
    args = parser.parse_args()
    wanted = [p for p in POINTS if p[0] in args.points.split(",")]
    result: dict = {
        "benchmark": "frontend CPU per streamed chat request, dyngraph beside Dynamo 1.6.1",
        "provenance": provenance(),
        "git": git_of(Path(__file__)),
        "workload": {
            "engine": "each stack's own mocker at speedup 10000",
            "output_tokens": 64,
            "short": "bench_frontend.py's chat, ~70 prompt tokens with the template",
            "one_message": "bench_long_prompts.py's one_message: a 4k-token document and a "
            "numbered question in one user message",
            "rounds": args.rounds,
        },
        "unit": "frontend process CPU-ms per request (/proc utime+stime)",
        "points": {},
    }
    with tempfile.TemporaryDirectory(prefix="vs-dynamo-") as tmp:
        for router, workers in sorted({(p[1], p[2]) for p in wanted}, reverse=True):
            points = [p for p in wanted if (p[1], p[2]) == (router, workers)]
            result["points"].update(compare(args, Path(tmp), router, workers, points))
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
