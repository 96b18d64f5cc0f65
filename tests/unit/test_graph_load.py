"""graph/load.py: composition, overrides, interpolation, environment, errors and the source map."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dynamo_graph.graph.errors import GraphError, Location, Problem
from dynamo_graph.graph.load import (
    OVERRIDE,
    SHIPPED_TEMPLATES,
    LoadedGraph,
    SourceMap,
    load_graph,
    state_dir,
)

REPO = Path(__file__).resolve().parents[2]

PLAIN = """\
name: plain
models:
  llm:
    path: /models/llm
components:
  backend:
    kind: worker
    model: llm
    replicas: 1
    placement: [local]
"""

TEMPLATE = """\
name: from-template
models:
  llm:
    path: /models/default
components:
  frontend:
    kind: frontend
    http:
      port: 8080
  backend:
    kind: worker
    model: llm
    replicas: 1
"""

GRAPH = """\
defaults:
  - /base
  - _self_
name: mine
components:
  backend:
    replicas: 3
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def problems(exc: pytest.ExceptionInfo[GraphError]) -> list[Problem]:
    return exc.value.problems


@pytest.fixture
def templated(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A graph in graphs/ using `/base` from a templates dir given by DYNGRAPH_TEMPLATES."""
    templates = tmp_path / "templates"
    write(templates / "base.yaml", TEMPLATE)
    return write(tmp_path / "graphs" / "g.yaml", GRAPH), {"DYNGRAPH_TEMPLATES": str(templates)}


def load_text(tmp_path: Path, text: str, overrides: tuple[str, ...] = (), **env: str) -> LoadedGraph:
    return load_graph(write(tmp_path / "graph.yaml", text), overrides, env=env)


# ---- loading and composing ----------------------------------------------------------------------


def test_plain_file(tmp_path: Path) -> None:
    graph = load_text(tmp_path, PLAIN)
    assert graph.data["components"]["backend"] == {
        "kind": "worker",
        "model": "llm",
        "replicas": 1,
        "placement": ["local"],
    }
    assert graph.file == tmp_path / "graph.yaml"
    assert graph.graph_dir == tmp_path
    assert graph.source.locate("components.backend.replicas") == Location(str(graph.file), 9)
    assert graph.source.locate("components.backend.placement.0") == Location(str(graph.file), 10)


def test_template_values_and_file_wins(templated: tuple[Path, dict[str, str]]) -> None:
    file, env = templated
    graph = load_graph(file, env=env)
    template = Path(env["DYNGRAPH_TEMPLATES"]) / "base.yaml"
    assert graph.data["name"] == "mine"
    assert graph.data["models"]["llm"]["path"] == "/models/default"
    assert graph.data["components"]["backend"] == {"kind": "worker", "model": "llm", "replicas": 3}
    assert "defaults" not in graph.data
    # where each value was set last: the file for its own keys, the template for the rest
    assert graph.source.locate("components.backend.replicas") == Location(str(file), 7)
    assert graph.source.locate("components.backend.model") == Location(str(template), 12)
    assert graph.source.locate("components.frontend.http.port") == Location(str(template), 9)
    assert graph.source.locate("name") == Location(str(file), 4)


def test_graph_named_like_its_template(tmp_path: Path) -> None:
    # graph_dir is searched after the templates, so /agg is the template, not this file
    write(tmp_path / "agg.yaml", "defaults: [/agg, _self_]\nname: ci-agg\n")
    graph = load_graph(tmp_path / "agg.yaml", env={})
    assert graph.data["name"] == "ci-agg"
    assert graph.data["components"]["backend"]["kind"] == "worker"
    assert graph.source.locate("components.backend.kind").file == str(SHIPPED_TEMPLATES / "agg.yaml")


def test_building_block_next_to_graph(tmp_path: Path) -> None:
    write(tmp_path / "common.yaml", "models:\n  llm:\n    path: /shared/llm\n")
    graph = load_text(tmp_path, "defaults: [/common, _self_]\nname: x\n")
    assert graph.data == {"models": {"llm": {"path": "/shared/llm"}}, "name": "x"}


def test_template_under_a_package(tmp_path: Path) -> None:
    write(tmp_path / "worker.yaml", "kind: worker\nreplicas: 2\n")
    graph = load_text(tmp_path, "defaults: ['/worker@components.w', _self_]\nname: x\n")
    assert graph.data["components"]["w"] == {"kind": "worker", "replicas": 2}
    assert graph.source.locate("components.w.replicas") == Location(str(tmp_path / "worker.yaml"), 2)


def test_yml_suffix(tmp_path: Path) -> None:
    graph = load_graph(write(tmp_path / "graph.yml", "defaults: [/agg, _self_]\nname: yml\n"), env={})
    assert graph.data["name"] == "yml"
    assert graph.source.locate("name") == Location(str(tmp_path / "graph.yml"), 2)


@pytest.mark.parametrize("template", ["agg", "disagg", "multi-host"])
def test_shipped_templates_compose(tmp_path: Path, template: str) -> None:
    graph = load_text(tmp_path, f"defaults: [/{template}, _self_]\nname: t\n")
    assert graph.data["name"] == "t"
    assert {c["kind"] for c in graph.data["components"].values()} == {"frontend", "worker"}


def test_disagg_template_roles_and_shared_engine(tmp_path: Path) -> None:
    graph = load_text(tmp_path, "defaults: [/disagg, _self_]\n", ("components.decode.engine=mocker",))
    comps = graph.data["components"]
    assert (comps["prefill"]["role"], comps["decode"]["role"]) == ("prefill", "decode")
    assert comps["prefill"]["engine"] == "mocker"  # follows decode through ${...}
    assert comps["frontend"]["router"]["mode"] == "kv"


def test_multi_host_template_reads_env(tmp_path: Path) -> None:
    env = {"DYNGRAPH_SSH_HOST": "10.0.0.7", "DYNGRAPH_SSH_USER": "me", "DYNGRAPH_KNOWN_HOSTS": "/keys/known"}
    graph = load_graph(write(tmp_path / "g.yaml", "defaults: [/multi-host, _self_]\n"), env=env)
    gpu1 = graph.data["hosts"]["gpu1"]
    assert gpu1["ssh"] == {"address": "10.0.0.7", "user": "me", "port": "22", "known_hosts": "/keys/known"}
    assert graph.data["components"]["backend"]["placement"] == ["gpu1"]
    assert graph.data["infra"] == {"etcd": {"managed": True}, "nats": {"managed": True}}


def test_example_graph() -> None:
    graph = load_graph(REPO / "graphs" / "examples" / "agg-from-template.yaml", env={})
    backend = graph.data["components"]["backend"]
    assert (backend["engine"], backend["replicas"], backend["model"]) == ("echo_core", 2, "llm")
    assert graph.data["components"]["frontend"]["http"] == {"host": "127.0.0.1", "port": 8090}


# ---- overrides ----------------------------------------------------------------------------------


def test_overrides_set_add_delete_force(templated: tuple[Path, dict[str, str]]) -> None:
    file, env = templated
    overrides = (
        "components.backend.replicas=4",
        "+components.backend.env.FOO=1",
        "~components.frontend",
        "++name=forced",
        "++components.backend.engine=echo_core",
        "+hosts={local: {gpus: 2}}",
    )
    graph = load_graph(file, overrides, env=env)
    backend = graph.data["components"]["backend"]
    assert backend == {
        "kind": "worker",
        "model": "llm",
        "replicas": 4,
        "env": {"FOO": 1},
        "engine": "echo_core",
    }
    assert "frontend" not in graph.data["components"]
    assert graph.data["name"] == "forced"
    assert graph.data["hosts"] == {"local": {"gpus": 2}}
    for path in ("components.backend.replicas", "components.backend.env.FOO", "name", "hosts.local.gpus"):
        assert graph.source.locate(path) == OVERRIDE, path
    assert "components.frontend" not in graph.source.entries
    assert graph.source.locate("components.backend.model").file.endswith("base.yaml")


def test_override_of_a_list_replaces_its_items(tmp_path: Path) -> None:
    graph = load_text(tmp_path, PLAIN, ("components.backend.placement=[a,b]",))
    assert graph.data["components"]["backend"]["placement"] == ["a", "b"]
    assert graph.source.locate("components.backend.placement.1") == OVERRIDE


@pytest.mark.parametrize(
    ("override", "key", "words"),
    [
        ("components.backend.replicas=[1", "components.backend.replicas", "cannot parse"),
        ("components.nope.replicas=4", "components.nope.replicas", "+components.nope.replicas=4"),
        ("+name=again", "name", "already"),
        ("~components.nope", "components.nope", "does not exist"),
        ("hydra.searchpath=[file:///x]", "hydra.searchpath", "not part of a graph"),
    ],
)
def test_bad_override(tmp_path: Path, override: str, key: str, words: str) -> None:
    with pytest.raises(GraphError) as exc:
        load_text(tmp_path, PLAIN, (override,))
    [problem] = problems(exc)
    assert problem.location == OVERRIDE
    assert problem.path == key
    assert override in problem.message
    assert words in problem.message


def test_every_malformed_override_reported(tmp_path: Path) -> None:
    with pytest.raises(GraphError) as exc:
        load_text(tmp_path, PLAIN, ("a=[", "name=ok", "b=}"))
    assert [p.path for p in problems(exc)] == ["a", "b"]


# ---- interpolation and environment --------------------------------------------------------------


def test_interpolation(tmp_path: Path) -> None:
    graph = load_text(
        tmp_path,
        """\
        name: interp
        models:
          llm: {path: /models/llm}
        hosts: [a, b]
        components:
          backend:
            model_path: ${models.llm.path}
            url: "http://${hosts.1}:80"
            model: ${models.llm}
        """,
    )
    backend = graph.data["components"]["backend"]
    assert backend == {"model_path": "/models/llm", "url": "http://b:80", "model": {"path": "/models/llm"}}
    # a key filled in by interpolation is located where the interpolation is written
    assert graph.source.locate("components.backend.model.path") == Location(str(graph.file), 9)


def test_env_resolvers_read_the_given_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DG_TEST_SET", raising=False)
    text = """\
    a: ${env:DG_TEST_SET}
    b: ${env:DG_TEST_UNSET,fallback}
    c: ${oc.env:DG_TEST_SET}
    d: ${oc.env:DG_TEST_UNSET,7}
    e: ${env:DG_TEST_UNSET,null}
    """
    graph = load_text(tmp_path, text, DG_TEST_SET="from-env")
    assert graph.data == {"a": "from-env", "b": "fallback", "c": "from-env", "d": "7", "e": None}


def test_env_defaults_to_os_environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DG_TEST_SET", "os")
    graph = load_graph(write(tmp_path / "g.yaml", "a: ${env:DG_TEST_SET}\n"))
    assert graph.data == {"a": "os"}


def test_unset_env_var(tmp_path: Path) -> None:
    text = """\
    name: x
    hosts:
      gpu1:
        ssh:
          address: ${env:DG_TEST_HOST}
    token: "Bearer ${oc.env:DG_TEST_TOKEN}"
    """
    with pytest.raises(GraphError) as exc:
        load_text(tmp_path, text)
    file = str(tmp_path / "graph.yaml")
    host, token = problems(exc)
    assert (host.path, host.location) == ("hosts.gpu1.ssh.address", Location(file, 5))
    assert "DG_TEST_HOST" in host.message and "not set" in host.message
    assert (token.path, token.location) == ("token", Location(file, 6))
    assert "DG_TEST_TOKEN" in token.message


def test_bad_interpolation_and_missing_value(tmp_path: Path) -> None:
    with pytest.raises(GraphError) as exc:
        load_text(tmp_path, "name: x\nmodel: ${models.nope.path}\npath: ???\n")
    model, path = problems(exc)
    assert (model.path, model.location) == ("model", Location(str(tmp_path / "graph.yaml"), 2))
    assert "models.nope.path" in model.message
    assert (path.path, path.location) == ("path", Location(str(tmp_path / "graph.yaml"), 3))


def test_missing_value_filled_by_override(tmp_path: Path) -> None:
    graph = load_text(tmp_path, "name: x\npath: ???\n", ("path=/m",))
    assert graph.data["path"] == "/m"


# ---- file problems ------------------------------------------------------------------------------


def test_yaml_syntax_error(tmp_path: Path) -> None:
    with pytest.raises(GraphError) as exc:
        load_text(tmp_path, "name: x\ncomponents:\n  backend: [1, 2\n  other: 3\n")
    [problem] = problems(exc)
    assert problem.location is not None
    assert problem.location.file == str(tmp_path / "graph.yaml")
    assert problem.location.line == 4
    assert "invalid YAML" in problem.message


def test_yaml_syntax_error_in_template(tmp_path: Path) -> None:
    write(tmp_path / "broken.yaml", "a: 1\nb: [\n")
    with pytest.raises(GraphError) as exc:
        load_text(tmp_path, "defaults: [/broken, _self_]\n")
    [problem] = problems(exc)
    assert problem.location is not None and problem.location.file == str(tmp_path / "broken.yaml")


@pytest.mark.parametrize(
    ("text", "words"), [("- a\n- b\n", "sequence"), ("", "empty"), ("just text\n", "scalar")]
)
def test_not_a_mapping(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(GraphError) as exc:
        load_text(tmp_path, text)
    [problem] = problems(exc)
    assert problem.path == "" and words in problem.message


def test_duplicate_keys(tmp_path: Path) -> None:
    with pytest.raises(GraphError) as exc:
        load_text(tmp_path, "name: a\ncomponents:\n  w: {}\n  w: {}\nname: b\n")
    file = str(tmp_path / "graph.yaml")
    assert [(p.path, p.location) for p in problems(exc)] == [
        ("components.w", Location(file, 4)),
        ("name", Location(file, 5)),
    ]


def test_missing_template(tmp_path: Path) -> None:
    with pytest.raises(GraphError) as exc:
        load_text(tmp_path, "name: x\ndefaults: [/nope, _self_]\n")
    [problem] = problems(exc)
    assert problem.path == "defaults"
    assert problem.location == Location(str(tmp_path / "graph.yaml"), 2)
    assert "nope" in problem.message and "graph.yaml" in problem.message


def test_graph_including_itself(tmp_path: Path) -> None:
    with pytest.raises(GraphError) as exc:
        load_graph(write(tmp_path / "loop.yaml", "defaults: [/loop]\n"), env={})
    assert problems(exc)[0].path == "defaults"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(GraphError) as exc:
        load_graph(tmp_path / "absent.yaml")
    assert problems(exc)[0].location == Location(str(tmp_path / "absent.yaml"))


def test_hydra_key_is_reserved(tmp_path: Path) -> None:
    with pytest.raises(GraphError) as exc:
        load_text(tmp_path, "name: x\nhydra:\n  job: {}\n")
    assert problems(exc)[0].path == "hydra"


# ---- process-level behaviour --------------------------------------------------------------------


def test_twice_in_one_process_is_deterministic(templated: tuple[Path, dict[str, str]]) -> None:
    file, env = templated
    first = load_graph(file, ["components.backend.replicas=2"], env=env)
    second = load_graph(file, ["components.backend.replicas=2"], env=env)
    assert first.data == second.data
    assert list(first.data) == list(second.data)
    assert first.source == second.source


def test_survives_global_hydra_left_initialized(tmp_path: Path) -> None:
    with initialize_config_dir(version_base=None, config_dir=str(tmp_path)):
        assert GlobalHydra.instance().is_initialized()
        graph = load_text(tmp_path, PLAIN)
    assert graph.data["name"] == "plain"
    assert not GlobalHydra.instance().is_initialized()


def test_source_map_locate_falls_back() -> None:
    source = SourceMap({"a": Location("f.yaml", 1), "a.b": Location("f.yaml", 2)}, Location("f.yaml"))
    assert source.locate("a.b.c.d") == Location("f.yaml", 2)
    assert source.locate("a.x") == Location("f.yaml", 1)
    assert source.locate("zzz") == Location("f.yaml")


def test_state_dir(tmp_path: Path) -> None:
    assert state_dir(tmp_path / "graphs" / "hello.yaml") == tmp_path / "graphs" / ".dyngraph" / "hello"
