"""`POST /v1/embeddings` through the official `openai` client's `embeddings.create`.

Against a llama.cpp embedding worker (the vectors must equal llama-cpp-python's own
`Llama.embed()` of the same texts), the mocker's embedding mode (deterministic vectors: order,
encodings, token-id inputs, `dimensions`, errors, metrics), and a chat model (which answers 400
naming the model, as an embedding model does to a chat request).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.metrics import metric
from tests.support.processes import ServerProcess, echo_core_args, running_server

np = pytest.importorskip("numpy")
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "zzz", "a", "hello there"]


@pytest.fixture(scope="module")
def mocker(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args_file = tmp_path_factory.mktemp("args") / "mocker.json"
    args_file.write_text(json.dumps({"embedding_dim": 64, "speedup_ratio": 100.0}))
    args = ["out=mocker", "--model-path", str(tiny_model), "--model-name", "emb", "--embedding"]
    args += ["--extra-engine-args", str(args_file), "--context-length", "64"]
    with running_server(args, log_dir=tmp_path_factory.mktemp("logs")) as proc:
        yield proc


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def vectors(server: ServerProcess, items: object, **kw: object) -> np.ndarray:
    response = client(server).embeddings.create(model="emb", input=items, **kw)  # type: ignore[arg-type]
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return np.array([d.embedding for d in response.data])


def test_batch_keeps_order_and_equals_single_requests(mocker: ServerProcess) -> None:
    batch = vectors(mocker, TEXTS)
    assert batch.shape == (len(TEXTS), 64)
    for i, text in enumerate(TEXTS):
        np.testing.assert_allclose(batch[i], vectors(mocker, text)[0], atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-6)
    # Inputs sharing tokens are closer than unrelated ones.
    assert batch[0] @ batch[4] > batch[0] @ batch[2]


def test_float_and_base64_agree(mocker: ServerProcess) -> None:
    as_float = vectors(mocker, TEXTS[:2], encoding_format="float")
    as_base64 = vectors(mocker, TEXTS[:2])  # the client asks for base64 and decodes it
    np.testing.assert_allclose(as_float, as_base64, atol=1e-6)  # float32 on the wire
    raw = httpx.post(
        f"{mocker.base_url}/v1/embeddings", json={"model": "emb", "input": "x", "encoding_format": "base64"}
    ).json()
    assert isinstance(raw["data"][0]["embedding"], str)


def test_token_id_inputs_equal_text_inputs(mocker: ServerProcess, tiny_model: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ids = [tokenizer.encode(t).ids for t in TEXTS[:3]]
    np.testing.assert_allclose(vectors(mocker, ids), vectors(mocker, TEXTS[:3]), atol=1e-6)
    np.testing.assert_allclose(vectors(mocker, ids[0])[0], vectors(mocker, TEXTS[0])[0], atol=1e-6)
    usage = client(mocker).embeddings.create(model="emb", input=ids).usage
    assert usage.prompt_tokens == usage.total_tokens == sum(len(i) for i in ids)


def test_dimensions_truncate_and_renormalize(mocker: ServerProcess) -> None:
    full = vectors(mocker, TEXTS[1])[0]
    short = vectors(mocker, TEXTS[1], dimensions=16)[0]
    assert short.shape == (16,)
    np.testing.assert_allclose(short, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "emb", "input": []}, "input"),
        ({"model": "emb", "input": [""]}, "input"),
        ({"model": "emb", "input": [1, 2, 999999]}, "input"),
        ({"model": "emb", "input": [[1, 2], "mixed"]}, "input"),
        ({"model": "emb", "input": [{"text": "x"}]}, "input"),
        ({"model": "emb", "input": "word " * 200}, "input"),
        ({"model": "emb", "input": "x", "dimensions": 0}, "dimensions"),
        ({"model": "emb", "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"model": "emb", "input": "x", "dimension": 8}, "dimension"),  # an unknown field
        ({"model": "emb"}, "input"),
        ({"model": "nope", "input": "x"}, "model"),
    ],
)
def test_bad_input_names_the_field(mocker: ServerProcess, body: dict, param: str) -> None:
    response = httpx.post(f"{mocker.base_url}/v1/embeddings", json=body)
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_chat_request_to_embedding_model_is_refused(mocker: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError, match="`emb` does not serve this endpoint") as err:
        client(mocker).chat.completions.create(model="emb", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["param"] == "model"  # type: ignore[index]
    listed = client(mocker).models.list().data[0]
    assert listed.endpoints == ["/v1/embeddings"]  # type: ignore[attr-defined]


def test_metrics_label_the_endpoint(mocker: ServerProcess) -> None:
    before = metric(mocker, "dynamo_frontend_requests_total", endpoint="embeddings")
    vectors(mocker, "counted")
    assert metric(mocker, "dynamo_frontend_requests_total", endpoint="embeddings") == before + 1


def test_embeddings_on_a_chat_model_answer_404(tiny_model: Path, tmp_path: Path) -> None:
    with running_server(echo_core_args(tiny_model, "chatty"), log_dir=tmp_path) as server:
        with pytest.raises(openai.NotFoundError, match="`chatty` does not serve this endpoint") as err:
            client(server).embeddings.create(model="chatty", input="hi")
        assert err.value.body["param"] == "model"  # type: ignore[index]


def test_llamacpp_vectors_equal_llama_cpp_pythons_own(tiny_model: Path, tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    gguf = tiny_model / "tiny-llama-f32.gguf"
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"pooling": "mean", "n_threads": 1}))
    args = ["out=llamacpp", "--model-path", str(gguf), "--model-name", "emb", "--embedding"]
    with running_server([*args, "--extra-engine-args", str(args_file)], log_dir=tmp_path) as server:
        ours = vectors(server, TEXTS)
        single = vectors(server, TEXTS[2])
    llm = llama_cpp.Llama(
        str(gguf), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, n_threads=1, verbose=False
    )
    try:
        theirs = np.array(llm.embed(TEXTS, normalize=True))
    finally:
        llm.close()
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    np.testing.assert_allclose(single[0], theirs[2], atol=1e-5)


def test_llamacpp_without_pooling_says_how_to_set_it(tiny_model: Path, tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from tests.support.processes import run_cli

    gguf = tiny_model / "tiny-llama-f32.gguf"
    done = run_cli(
        ["run", "in=http", "out=llamacpp", str(gguf), "--embedding", "--http-port", "0"], timeout=60
    )
    assert done.returncode != 0
    assert '"pooling"' in done.stderr + done.stdout


def test_an_embedding_model_is_not_chatted_with_on_stdin(tiny_model: Path) -> None:
    from tests.support.processes import run_cli

    done = run_cli(["run", "out=mocker", str(tiny_model), "--embedding"], input_text="hi\n", timeout=60)
    assert done.returncode != 0
    assert "serve it with in=http" in done.stderr + done.stdout
