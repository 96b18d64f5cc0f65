"""The checks of a graph that has no `tests`: what any serving graph should pass.

Its frontend lists every model it serves, and answers one chat, one streamed chat and one
completion request to the first of them with status 200, a finish reason and at least one
token. A graph without a frontend has nothing to ask: its check is that it comes up.
"""

from __future__ import annotations

from dynamo_graph.graph.schema import Expect, Graph, SmokeChat, SmokeCheck, SmokeCompletion, TokenCount


def served_models(graph: Graph, frontend: str) -> list[str]:
    """Names of the models a frontend serves (its `models`, default all), in graph order."""
    keys = graph.frontends()[frontend].models or list(graph.models)
    return [graph.models[k].name or k for k in keys if k in graph.models]


def default_checks(graph: Graph) -> list[SmokeCheck]:
    frontends = graph.frontends()
    if not frontends:
        return []
    models = served_models(graph, next(iter(frontends)))
    answered = Expect(completion_tokens=TokenCount(min=1))
    prompt = "Say hello to the smoke test."
    return [
        SmokeCheck(name="models listed", models=models),
        SmokeCheck(name="chat", chat=SmokeChat(prompt=prompt, max_tokens=8), expect=answered),
        SmokeCheck(
            name="chat, streamed", chat=SmokeChat(prompt=prompt, max_tokens=8, stream=True), expect=answered
        ),
        SmokeCheck(
            name="completion", completion=SmokeCompletion(prompt=prompt, max_tokens=8), expect=answered
        ),
    ]
