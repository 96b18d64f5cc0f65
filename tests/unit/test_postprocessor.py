"""Stop conditions, held stop-string prefixes and token accounting of the postprocessor."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from tokenizers import Tokenizer

from dynamo_graph.backend.protocol import LLMEngineOutput, OutputOptions, PreprocessedRequest, StopConditions
from dynamo_graph.dev.tiny_tokenizer import END_OF_TEXT_ID, EOT_ID
from dynamo_graph.llm.detokenizer import DetokenizerFactory
from dynamo_graph.llm.postprocessor import Postprocessor, StopStringMatcher

EOS = [EOT_ID, END_OF_TEXT_ID]


@pytest.fixture
def enc(tokenizer: Tokenizer) -> Callable[[str], list[int]]:
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def _pp(factory: DetokenizerFactory, *, skip: bool = False, **stop: object) -> Postprocessor:
    stop.setdefault("stop_token_ids_hidden", EOS)
    return Postprocessor(factory.new(skip_special_tokens=skip), StopConditions(**stop))  # type: ignore[arg-type]


def _run(
    pp: Postprocessor, chunks: list[list[int]], last_finish: str | None = None
) -> tuple[str, str | None]:
    """Feed chunks until done, as the frontend does; returns (all text, finish reason)."""
    text, finish = [], None
    for n, ids in enumerate(chunks, 1):
        delta, finish = pp.process(
            LLMEngineOutput(token_ids=ids, finish_reason=last_finish if n == len(chunks) else None)
        )
        text.append(delta)
        if pp.done:
            break
    else:
        text.append(pp.finish())
    return "".join(text), finish


def _singles(ids: list[int]) -> list[list[int]]:
    return [[i] for i in ids]


def test_plain_stream(detok_factory: DetokenizerFactory, enc) -> None:
    ids = enc("Hello, wörld 😀!")
    pp = _pp(detok_factory)
    assert _run(pp, _singles(ids), "length") == ("Hello, wörld 😀!", "length")
    assert pp.completion_tokens == len(ids)
    assert pp.done and pp.finish_reason == "length"


def test_eos_stops_hidden_and_counted(detok_factory: DetokenizerFactory, enc) -> None:
    ids = enc("Done here")
    pp = _pp(detok_factory)
    assert _run(pp, _singles([*ids, EOT_ID, *enc(" never shown")])) == ("Done here", "stop")
    assert pp.completion_tokens == len(ids) + 1  # the eos counts, as in vLLM
    assert pp.process(LLMEngineOutput(token_ids=enc("more"))) == ("", None)


def test_eos_inside_a_chunk_drops_the_rest(detok_factory: DetokenizerFactory, enc) -> None:
    ids = enc("abc")
    pp = _pp(detok_factory)
    assert pp.process(LLMEngineOutput(token_ids=[*ids, END_OF_TEXT_ID, *enc("xyz")])) == ("abc", "stop")
    assert pp.completion_tokens == len(ids) + 1


def test_ignore_eos_shows_eos_and_runs_to_length(detok_factory: DetokenizerFactory, enc) -> None:
    ids = [*enc("a"), EOT_ID, *enc("b")]
    assert _run(_pp(detok_factory, ignore_eos=True, max_tokens=3), _singles(ids)) == (
        "a<|eot_id|>b",
        "length",
    )
    assert _run(_pp(detok_factory, skip=True, ignore_eos=True, max_tokens=3), _singles(ids)) == (
        "ab",
        "length",
    )


def test_ignore_eos_keeps_requested_stop_token_ids(detok_factory: DetokenizerFactory, enc) -> None:
    stop_id = enc("z")[0]
    pp = _pp(detok_factory, ignore_eos=True, stop_token_ids=[stop_id])
    assert _run(pp, _singles([*enc("a"), EOT_ID, stop_id, *enc("b")])) == ("a<|eot_id|>", "stop")


def test_min_tokens_suppresses_eos(detok_factory: DetokenizerFactory, enc) -> None:
    a, b = enc("a")[0], enc("b")[0]
    pp = _pp(detok_factory, skip=True, min_tokens=3)
    # eos at positions 2 and 3 are ordinary tokens; at position 5 (> min_tokens) it stops.
    assert _run(pp, _singles([a, EOT_ID, EOT_ID, b, EOT_ID, a])) == ("ab", "stop")
    assert pp.completion_tokens == 5


def test_requested_stop_token_ids(detok_factory: DetokenizerFactory, enc) -> None:
    stop_id = enc("!")[0]
    pp = _pp(detok_factory, stop_token_ids=[stop_id])
    assert _run(pp, _singles(enc("Hi! there"))) == ("Hi", "stop")


def test_max_tokens_length_truncates_chunk(
    detok_factory: DetokenizerFactory, tokenizer: Tokenizer, enc
) -> None:
    ids = enc("one two three four five")
    pp = _pp(detok_factory, max_tokens=3)
    assert pp.process(LLMEngineOutput(token_ids=ids)) == (tokenizer.decode(ids[:3]), "length")
    assert pp.completion_tokens == 3 and pp.done


def test_eos_as_last_allowed_token_is_stop_not_length(detok_factory: DetokenizerFactory, enc) -> None:
    pp = _pp(detok_factory, max_tokens=2)
    assert _run(pp, _singles([*enc("a"), EOT_ID])) == ("a", "stop")


@pytest.mark.parametrize(
    ("engine", "expected"),
    [("eos", "stop"), ("stop", "stop"), ("length", "length"), ("cancelled", "cancelled"), ("error", "error")],
)
def test_engine_finish_reasons(detok_factory: DetokenizerFactory, enc, engine: str, expected: str) -> None:
    assert _run(_pp(detok_factory), _singles(enc("hi")), engine) == ("hi", expected)


def test_engine_finish_flushes_truncated_character(detok_factory: DetokenizerFactory, enc) -> None:
    ids = enc("😀")[:-1]
    assert _run(_pp(detok_factory), _singles(ids), "length") == ("\ufffd", "length")


def _text_chunks(enc, *pieces: str) -> list[list[int]]:
    return [enc(p) for p in pieces]


def test_stop_string_spanning_chunks(detok_factory: DetokenizerFactory, enc) -> None:
    pp = _pp(detok_factory, stop=["STOP"])
    first = pp.process(LLMEngineOutput(token_ids=enc("go ST")))
    assert first == ("go ", None)  # "ST" could start "STOP": held
    assert pp.process(LLMEngineOutput(token_ids=enc("OP and more"))) == ("", "stop")
    assert pp.done


def test_stop_string_over_three_chunks(detok_factory: DetokenizerFactory, enc) -> None:
    chunks = _text_chunks(enc, "x <en", "d_of", "_turn> y")
    assert _run(_pp(detok_factory, stop=["<end_of_turn>"]), chunks) == ("x ", "stop")


def test_false_prefix_is_released(detok_factory: DetokenizerFactory, enc) -> None:
    pp = _pp(detok_factory, stop=["STOP"])
    assert pp.process(LLMEngineOutput(token_ids=enc("S"))) == ("", None)
    assert pp.process(LLMEngineOutput(token_ids=enc("x"))) == ("Sx", None)
    assert pp.process(LLMEngineOutput(token_ids=enc(" ST"), finish_reason="length")) == (" ST", "length")


def test_held_prefix_released_by_finish(detok_factory: DetokenizerFactory, enc) -> None:
    pp = _pp(detok_factory, stop=["STOP"])
    assert pp.process(LLMEngineOutput(token_ids=enc("end ST"))) == ("end ", None)
    assert pp.finish() == "ST"
    assert pp.finish() == ""
    assert pp.finish_reason is None


def test_stop_string_in_split_multibyte_character(detok_factory: DetokenizerFactory, enc) -> None:
    ids = enc("family 👩‍👩‍👧 then 中文 rest")
    assert _run(_pp(detok_factory, stop=["👧"]), _singles(ids)) == ("family 👩\u200d👩\u200d", "stop")
    assert _run(_pp(detok_factory, stop=["中文"]), _singles(ids)) == (
        "family 👩\u200d👩\u200d👧 then ",
        "stop",
    )
    # The stop string starts with a character that is still incomplete: nothing leaks early.
    assert _run(_pp(detok_factory, stop=["文 r"]), _singles(ids)) == (
        "family 👩\u200d👩\u200d👧 then 中",
        "stop",
    )


def test_several_stop_strings_earliest_wins(detok_factory: DetokenizerFactory, enc) -> None:
    ids = enc("hello world, and more")
    assert _run(_pp(detok_factory, stop=["world", "lo w"]), _singles(ids)) == ("hel", "stop")
    assert _run(_pp(detok_factory, stop=["zzz", ", a"]), _singles(ids)) == ("hello world", "stop")


def test_overlapping_prefixes_hold_the_longest(detok_factory: DetokenizerFactory, enc) -> None:
    pp = _pp(detok_factory, stop=["aab", "ab!"])
    assert pp.process(LLMEngineOutput(token_ids=enc("xaa"))) == ("x", None)
    assert pp.process(LLMEngineOutput(token_ids=enc("a"))) == ("a", None)
    assert pp.process(LLMEngineOutput(token_ids=enc("b?"))) == ("", "stop")


def test_long_stop_string_one_character_at_a_time() -> None:
    stop = "ab" * 20 + "!"
    matcher = StopStringMatcher([stop])
    text = "x" + "ab" * 30 + "?" + stop + "tail"  # a long false start, then the real thing
    shown = []
    for ch in text:
        piece, matched = matcher.feed(ch)
        shown.append(piece)
        if matched:
            break
    assert matched and "".join(shown) == "x" + "ab" * 30 + "?"


def test_stop_string_after_min_tokens_only(detok_factory: DetokenizerFactory, enc) -> None:
    ids = enc("ab ab ab")
    n_first = len(enc("ab"))
    pp = _pp(detok_factory, stop=["ab"], min_tokens=n_first)
    assert _run(pp, _singles(ids)) == ("ab ", "stop")


def test_special_tokens_via_request(detok_factory: DetokenizerFactory, enc) -> None:
    ids = [*enc("a"), 2, *enc("b")]
    for skip, expected in ((False, "a<|start_header_id|>b"), (True, "ab")):
        request = PreprocessedRequest(
            model="m",
            token_ids=enc("prompt"),
            stop_conditions=StopConditions(stop_token_ids_hidden=EOS),
            output_options=OutputOptions(skip_special_tokens=skip),
        )
        pp = Postprocessor.for_request(detok_factory, request)
        assert _run(pp, _singles([*ids, EOT_ID])) == (expected, "stop")


def test_split_invariance(detok_factory: DetokenizerFactory, tokenizer: Tokenizer, enc) -> None:
    """Any chunking of the same token stream gives the same text, finish reason and count."""
    texts = [
        "The end is near. STOP right there 👩‍👩‍👧 中文",
        "no stop string here at all, e\u0301 😀🇫🇷",
        "almost ST but not; then S T O P; then finally STOP.",
        "中文中文字 and then 字符 END",
    ]
    stops = [["STOP"], ["中文字", "END"], ["T O", "😀🇫"], ["\n\n"]]
    rng = random.Random(7)
    for text in texts:
        ids = [*enc(text), EOT_ID, *enc("tail")]
        for stop in stops:
            for max_tokens in (None, len(ids) // 2):
                reference_pp = _pp(detok_factory, stop=stop, max_tokens=max_tokens)
                reference = _run(reference_pp, _singles(ids))
                for _ in range(20):
                    chunks, i = [], 0
                    while i < len(ids):
                        step = rng.randint(1, 5)
                        chunks.append(ids[i : i + step])
                        i += step
                    pp = _pp(detok_factory, stop=stop, max_tokens=max_tokens)
                    assert _run(pp, chunks) == reference, (text, stop, chunks)
                    # A stop string counts the rest of its chunk's tokens (chunks hold <= 5).
                    assert 0 <= pp.completion_tokens - reference_pp.completion_tokens <= 4


@pytest.mark.parametrize(
    ("stops", "pieces", "expected"),
    [
        (["abc"], ["xa", "b", "c!"], ("x", True)),
        (["abc"], ["ab", "ab", "c"], ("ab", True)),
        (["abc"], ["ab", "x"], ("abx", False)),
        (["aXa"], ["aX", "aXa"], ("", True)),
        (["aXa"], ["aX", "X", "aXa"], ("aXX", True)),
        (["ab", "b!"], ["ab"], ("", True)),
    ],
)
def test_matcher_table(stops: list[str], pieces: list[str], expected: tuple[str, bool]) -> None:
    matcher = StopStringMatcher(stops)
    out, matched = [], False
    for piece in pieces:
        text, matched = matcher.feed(piece)
        out.append(text)
        if matched:
            break
    if not matched:
        out.append(matcher.release())
    assert ("".join(out), matched) == expected
