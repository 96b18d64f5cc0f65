"""The stumbles of a newcomer's first hour (issue 31), each as the command line meets it: the
message, the exit code, and no traceback."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import time
import tomllib
from pathlib import Path

import pytest
import yaml

from dynamo_graph.engines.llamacpp.args import INSTALL_HINT as LLAMACPP_HINT
from dynamo_graph.engines.registry import ENGINES
from dynamo_graph.graph.build import build
from dynamo_graph.graph.errors import GraphError
from dynamo_graph.graph.load import load_graph
from dynamo_graph.graph.paths import CHECKOUT_TINY_MODEL
from dynamo_graph.graph.validate import gpu_warnings
from tests.support.processes import DYNGRAPH, free_port, run_cli

REPO = Path(__file__).resolve().parents[2]
HELLO = REPO / "graphs" / "hello.yaml"


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(GraphError) as e:
        build(HELLO, overrides, env={})
    return [str(p) for p in e.value.problems]


# ---- 6: overrides get the did-you-mean the file's keys get -------------------------------------


def test_a_misspelled_override_key_is_named_with_the_key_it_likely_means() -> None:
    assert _problems("components.frontend.http.prot=8081") == [
        "<override>: components.frontend.http.prot: unknown key 'prot'; did you mean 'port'?"
    ]
    assert _problems("compnents.frontend.http.port=1") == [
        "<override>: compnents: unknown key 'compnents'; did you mean 'components'?"
    ]


def test_a_misspelled_component_name_in_an_override_is_named_not_a_missing_kind() -> None:
    assert _problems("components.frontnd.http.port=8081") == [
        "<override>: components.frontnd: components has no 'frontnd'; did you mean 'frontend'? "
        "(`+components.frontnd.http.port=8081` adds it)"
    ]
    assert _problems("~components.backnd") == [
        "<override>: components.backnd: components has no 'backnd'; did you mean 'backend'?"
    ]


def test_new_names_and_keys_the_schema_has_still_need_no_plus() -> None:
    built = build(HELLO, ["hosts.local.gpus=0", "components.backend.engine_args.foo=1"], env={})
    assert built.graph.components["backend"].engine_args == {"foo": 1}


def test_a_port_out_of_range_is_one_problem_in_our_words() -> None:
    assert _problems("components.frontend.http.port=99999") == [
        "<override>: components.frontend.http.port: must be <= 65535 or auto, got 99999"
    ]


def test_override_typo_from_the_command_line() -> None:
    done = run_cli(["validate", str(HELLO), "components.frontend.http.prot=8081"])
    assert done.returncode == 2
    assert "unknown key 'prot'; did you mean 'port'?" in done.stderr
    assert "Traceback" not in done.stdout + done.stderr


# ---- 8: one served name, Python engine files, a relative DYNGRAPH_MODEL -------------------------


def test_graphs_on_the_tiny_model_serve_it_as_tiny_model() -> None:
    """The README's curl asks for `tiny-model`: every shipped graph that serves the tiny model
    once serves it so (embeddings.yaml serves it twice, for chat and embeddings, by two names)."""
    served = {}
    for file in sorted((REPO / "graphs").rglob("*.yaml")):
        models = (yaml.safe_load(file.read_text()).get("models") or {}).items()
        tiny = [m.get("name", k) for k, m in models if str(m.get("path", "")).endswith(".cache/tiny-model")]
        if len(tiny) == 1:
            served[file.name] = tiny[0]
    assert "hello.yaml" in served and "disagg-mocker.yaml" in served
    assert set(served.values()) == {"tiny-model"}, served


def test_a_pytok_engine_file_resolves_against_the_graph_folder(tmp_path: Path, tiny_model: Path) -> None:
    (tmp_path / "engine.py").write_text("async def generate(request):\n    yield {'token_ids': [1]}\n")
    graph = tmp_path / "g.yaml"
    graph.write_text(
        f"name: g\nmodels: {{m: {{path: {tiny_model}}}}}\n"
        "components:\n  backend: {kind: worker, model: m, engine: 'pytok:engine.py'}\n"
    )
    built = build(graph, env={})
    (backend,) = built.plan.processes
    assert f"out=pytok:{tmp_path / 'engine.py'}" in backend.argv
    done = run_cli(["validate", "--preflight", str(graph)])
    assert done.returncode == 0, done.stdout + done.stderr
    (tmp_path / "engine.py").unlink()
    done = run_cli(["validate", "--preflight", str(graph)])
    assert done.returncode == 2
    assert f"components.backend.engine: {tmp_path / 'engine.py'} does not exist" in done.stderr
    assert "pytok:" not in done.stderr and "Traceback" not in done.stderr


def test_a_relative_dyngraph_model_is_taken_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "models" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    template_graph = REPO / "graphs" / "examples" / "agg-from-template.yaml"
    loaded = load_graph(template_graph, env={"DYNGRAPH_MODEL": "models/mine"})
    assert loaded.data["models"]["llm"]["path"] == str(tmp_path / "models" / "mine")
    # A hub id stays one; the default (written in the template) stays as written.
    loaded = load_graph(template_graph, env={"DYNGRAPH_MODEL": "org/model"})
    assert loaded.data["models"]["llm"]["path"] == "org/model"
    assert load_graph(template_graph, env={}).data["models"]["llm"]["path"] == "Qwen/Qwen3-0.6B"


def test_a_missing_relative_dyngraph_model_suggests_building_it_where_looked_for(tmp_path: Path) -> None:
    template_graph = REPO / "graphs" / "examples" / "agg-from-template.yaml"
    done = run_cli(
        ["validate", "--preflight", str(template_graph)],
        env={"DYNGRAPH_MODEL": ".cache/tiny-model"},
        cwd=tmp_path,
    )
    assert done.returncode == 2
    wanted = tmp_path / ".cache" / "tiny-model"
    assert f"models.llm.path: {wanted} does not exist; build the tiny test model there with " in done.stderr
    assert f"`dyngraph dev tiny-model {wanted}`" in done.stderr
    assert "make tiny-model" not in done.stderr  # make builds the checkout's, not this one
    assert "Traceback" not in done.stderr


# ---- 1: a remote host without ssh.user -------------------------------------------------------


def test_multi_host_template_without_an_ssh_user_names_the_unreachable_host() -> None:
    port = free_port()  # nothing listens there
    env = {k: v for k, v in os.environ.items() if k != "DYNGRAPH_SSH_USER"}
    overrides = ["hosts.gpu1.ssh.address=127.0.0.1", f"hosts.gpu1.ssh.port={port}"]
    for command in (["up", "--dry-run"], ["validate", "--preflight"]):
        done = subprocess.run(
            [*DYNGRAPH, *command, str(REPO / "graphs" / "templates" / "multi-host.yaml"), *overrides],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"hosts.gpu1.ssh.address: host 'gpu1' (127.0.0.1:{port}): unreachable" in done.stderr
        assert "Traceback" not in done.stdout + done.stderr


# ---- 2 and 7: a busy port, and dyngraph on the PATH -------------------------------------------


def test_run_on_a_busy_port_says_so_in_one_line_with_the_flag(tiny_model: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run_cli(["run", "in=http", "out=echo_core", str(tiny_model), "--http-port", str(port)])
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"error: port {port} on 127.0.0.1 is already in use: stop what listens there, "
        "or serve on another port with --http-port PORT"
    )
    assert "serving" not in done.stdout


def test_a_frontend_group_on_a_busy_port_stops_at_once() -> None:
    """--http-processes: the group does not restart a process that cannot have the port."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        done = run_cli(["run", "in=http", "out=auto", "--http-port", str(port), "--http-processes", "2"])
    assert done.returncode == 2
    assert f"error: port {port} on 127.0.0.1 is already in use" in done.stderr
    assert "restarting" not in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - started < 20


def test_up_on_a_busy_port_names_the_override(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run_cli(["validate", "--preflight", str(HELLO), f"components.frontend.http.port={port}"])
    assert done.returncode == 2
    assert (
        f"components.frontend.http.port: port {port} is already taken on host 'local': stop what listens "
        "there, or give another on the command line: components.frontend.http.port=PORT"
    ) in done.stderr
    assert "Traceback" not in done.stderr


def test_make_run_names_the_path_and_the_port_variable() -> None:
    """`make -n` prints what `make run` would do without doing it (or installing anything)."""
    done = subprocess.run(
        ["make", "-n", "run", "HTTP_PORT=18555"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "/.venv/bin/activate" in done.stdout  # how to get `dyngraph` on the PATH of a new shell
    assert "components.frontend.http.port=18555" in done.stdout
    assert "make run HTTP_PORT=8081" in done.stdout


# ---- 3: installing an engine's extra -----------------------------------------------------------


def test_the_llamacpp_extra_is_the_one_make_installs_and_messages_name_both() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (pinned,) = [r for r in extras["llamacpp"] if r.startswith("llama-cpp-python")]
    assert f"'{pinned}'" in (REPO / "Makefile").read_text()
    hint = ENGINES["llamacpp"].install
    assert hint is not None and "`make llamacpp`" in hint and "pip install -e '.[llamacpp]'" in hint
    assert "make llamacpp" in LLAMACPP_HINT
    for spec in ENGINES.values():  # dyngraph is not on PyPI: `pip install 'dyngraph[x]'` finds nothing
        assert spec.install is None or "dyngraph[" not in spec.install


# ---- 4: a Dynamo deployment imported and run on a machine without GPUs -------------------------

VLLM_DISAGG = REPO / "tests" / "fixtures" / "dynamo" / "examples" / "vllm-disagg.yaml"


def test_import_prints_the_command_that_runs_it_here_and_it_passes_preflight(
    tmp_path: Path, tiny_model: Path
) -> None:
    graph = tmp_path / "graph.yaml"
    done = run_cli(["import", str(VLLM_DISAGG), "-o", str(graph)])
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    # "...on the mocker:", or "...on the mocker (after `make tiny-model` ...):" in a fresh checkout
    at = next(i for i, line in enumerate(lines) if line.startswith("to run it on this machine without GPUs"))
    command = shlex.split(lines[at + 1])
    assert command[:3] == ["dyngraph", "up", str(graph)]
    assert "components.VllmPrefillWorker.engine=mocker" in command  # every worker, not only decode
    assert f"models.Qwen3-0-6B.path={CHECKOUT_TINY_MODEL}" in command  # absolute: no cwd to guess
    overrides = [o.replace(str(CHECKOUT_TINY_MODEL), str(tiny_model)) for o in command[3:]]  # built here
    checked = run_cli(["validate", "--preflight", str(graph), *overrides])
    assert checked.returncode == 0, checked.stderr
    assert "Traceback" not in done.stderr + checked.stderr


def test_mocker_workers_that_ask_for_gpus_pass_preflight_on_a_host_without_them(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The shorter recipe, engines swapped but GPU requests kept: a warning, not a refusal."""
    graph = tmp_path / "graph.yaml"
    assert run_cli(["import", str(VLLM_DISAGG), "-o", str(graph)]).returncode == 0
    overrides = [
        f"models.Qwen3-0-6B.path={tiny_model}",
        "components.VllmDecodeWorker.engine=mocker",
        "components.VllmPrefillWorker.engine=mocker",
    ]
    checked = run_cli(["validate", "--preflight", str(graph), *overrides])
    assert checked.returncode == 0, checked.stderr
    assert "GPU" not in checked.stderr
    warnings = gpu_warnings(build(graph, overrides, env={}).graph)
    assert warnings == [
        f"components.{key}.gpus: engine mocker uses no GPUs; the 1 per replica it asks for need not "
        "exist on its host"
        for key in ("VllmDecodeWorker", "VllmPrefillWorker")
    ]
