"""The mocker's scheduler driven step by step (no event loop, no clock), and the tokens each
sequence got: the scheduler and priority unit tests share these."""

from __future__ import annotations

from dynamo_graph.engines.mocker.args import MockerArgs
from dynamo_graph.engines.mocker.scheduler import MockSequence, Scheduler, StepResult

VOCAB = 1000


def scheduler(**kw: object) -> Scheduler:
    return Scheduler(MockerArgs(**kw), max_model_len=4096)  # type: ignore[arg-type]


def run(sched: Scheduler, limit: int = 10_000) -> list[StepResult]:
    steps = []
    while sched.has_work():
        steps.append(sched.step())
        assert len(steps) < limit, "the scheduler does not make progress"
    return steps


def tokens_out(steps: list[StepResult], s: MockSequence) -> list[int]:
    return [t for step in steps for q, out in step.outputs if q is s for t in out.token_ids]
