"""Checks the adapters of engine libraries (vLLM, SGLang, TensorRT-LLM) make of their settings.

Each adapter maps dyngraph's flags onto its library's own arguments and merges
`--extra-engine-args` over them; what they share is how a bad setting is refused: a missing
package says how to install it, a key that contradicts a flag given on the command line names
both, and an unknown key lists the closest and all valid names.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable, Mapping
from typing import Any

from dynamo_graph.backend.settings import EngineSettings

SOURCE = "--extra-engine-args"


def import_engine_package(name: str, hint: str, error: type[Exception]) -> Any:
    """Import the engine's package, or raise `error` with the install hint and the reason."""
    try:
        return importlib.import_module(name)
    except Exception as err:  # ImportError, or a broken install (e.g. CUDA libraries on CPU)
        raise error(f"{hint} ({type(err).__name__}: {err})") from None


def refuse_flag_conflicts(
    cfg: EngineSettings,
    flags: Mapping[str, tuple[str, str]],
    ours: Mapping[str, Any],
    theirs: Mapping[str, Any],
    error: type[Exception],
) -> None:
    """A flag given on the command line that `--extra-engine-args` contradicts is an error naming both.

    `flags`: flag attribute -> (flag name, engine key); `ours`: the engine keys the flags set;
    `theirs`: the engine keys of `--extra-engine-args`."""
    for attr, (flag, key) in flags.items():
        if key in theirs and key in ours and cfg.flag_given(attr) and theirs[key] != ours[key]:
            raise error(
                f"{flag} {getattr(cfg, attr)} conflicts with {key}={theirs[key]!r} in {SOURCE}; give one"
            )


def refuse_unknown_keys(
    kwargs: Mapping[str, Any], names: Iterable[str], *, what: str, noun: str, error: type[Exception]
) -> None:
    """Refuse keys that are not among `names`, naming the closest and all valid ones
    (`what` and `noun` say what they are: "vLLM AsyncEngineArgs", "field")."""
    valid = sorted(set(names))
    unknown = [key for key in kwargs if key not in valid]
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = [v for v in valid if v.startswith(key)][:3] or difflib.get_close_matches(key, valid, n=3)
        hints.append(f"{key!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
    raise error(
        f"{SOURCE}: unknown {what} {noun}{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; "
        f"valid {noun}s: {', '.join(valid)}"
    )
