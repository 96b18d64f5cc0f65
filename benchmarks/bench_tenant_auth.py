"""Micro-benchmark: the frontend CPU a request spends on API keys with tenants (docs/security.md):
finding the tenant of a bearer token in a keys file of many tenants, its limits (admit, charge,
release), its cache salt, and the salted hashing of a prompt in the KV router; with the plain
`--api-key` check (every key compared) for scale.

Run: .venv/bin/python benchmarks/bench_tenant_auth.py [--tenants 1000] [--iterations 20000]
Writes benchmarks/results/tenant_auth.json. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from dynamo_graph.bench.provenance import provenance
from dynamo_graph.bench.stats import cpu_us_per_call
from dynamo_graph.frontend.auth import ApiKeys
from dynamo_graph.frontend.tenants import Tenants, cache_salt, entry_yaml
from dynamo_graph.router.kv.hashing import local_block_hashes

RESULT = Path(__file__).parent / "results" / "tenant_auth.json"
PROMPT = list(range(1, 2049))  # 2048 tokens, 128 blocks of 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=1000, help="tenants (one key each) in the keys file")
    parser.add_argument("--iterations", type=int, default=20000, help="calls per round")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()

    keys = [f"sk-bench-{i:06d}-0123456789abcdef" for i in range(args.tenants)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "keys.yaml"
        entries = "".join(entry_yaml(f"team-{i}", key) for i, key in enumerate(keys))
        limits = "".join(
            f"    {field}: {value}\n"
            for field, value in (
                ("requests_per_minute", 10**9),
                ("tokens_per_minute", 10**9),
                ("max_concurrent", 1000),
            )
        )
        last = entry_yaml("limited", "sk-limited-key").rstrip("\n") + "\n" + limits
        path.write_text("keys:\n" + entries + last)
        start = time.perf_counter()
        tenants = Tenants(str(path))
        load_ms = (time.perf_counter() - start) * 1e3
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]
    token = keys[len(keys) // 2].encode()
    asked = [*headers, (b"authorization", b"Bearer " + token)]
    plain = ApiKeys(keys)
    limited = tenants.find(b"sk-limited-key")
    assert limited is not None and tenants.find(token) is not None

    def find_tenant() -> object:
        return tenants.find(ApiKeys.presented(asked))

    def limits_cycle() -> None:
        request = limited.admit()
        request.prompt(512)
        request.ended("success", 512, 64)
        request.release()

    def salt() -> object:
        return cache_salt(limited.tenant, None)

    results = {
        "tenants": args.tenants,
        "load_keys_file_ms": round(load_ms, 2),
        "find_tenant_us": cpu_us_per_call(find_tenant, args.iterations),
        "plain_api_key_check_us": cpu_us_per_call(lambda: plain.check(asked), max(1, args.iterations // 100)),
        "limits_admit_charge_release_us": cpu_us_per_call(limits_cycle, args.iterations),
        "cache_salt_us": cpu_us_per_call(salt, args.iterations),
        "block_hashes_2048_tokens_us": cpu_us_per_call(
            lambda: local_block_hashes(PROMPT, 16), args.iterations // 10
        ),
        "salted_block_hashes_2048_tokens_us": cpu_us_per_call(
            lambda: local_block_hashes(PROMPT, 16, salt='["tenant:team-1",null]'), args.iterations // 10
        ),
    }
    results = {k: round(v, 3) if isinstance(v, float) else v for k, v in results.items()}
    per_request = (
        results["find_tenant_us"] + results["limits_admit_charge_release_us"] + results["cache_salt_us"]
    )
    results["tenant_per_request_us"] = round(per_request, 3)
    for name, value in results.items():
        print(f"{name:40s} {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"provenance": provenance(), "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
