"""Graph sections built from the settings classes of the rooms below (dynamo_graph/options.py),
so a setting's type, default, bounds and docs are written once for `dyngraph run` and the graph.

A section is a pydantic model (strict, like every graph model) with one field per setting of its
classes that the graph has (`in_graph`), the setting's docstring as its description (with the
flag it compiles to), and a validator that runs the classes' own `check`, naming graph keys.
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, Field, create_model, model_validator

from dynamo_graph.options import SettingError, field_docs, options


def section(
    name: str,
    base: type[BaseModel],
    *classes: type,
    overrides: dict[str, tuple[Any, Any, str]] | None = None,
) -> type[BaseModel]:
    """A model named `name` (on `base`) with the graph's fields of `classes`; `overrides` gives
    a field another (annotation, default, more doc) where the graph spells it differently (a
    port that may be `auto`)."""
    overrides = overrides or {}
    fields: dict[str, Any] = {}
    owners: dict[type, list[str]] = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for opt in options(cls):
            if not opt.spec.in_graph:
                continue
            annotation, default, more = overrides.get(opt.name, (hints[opt.name], opt.default, ""))
            description = " ".join(part for part in (docs.get(opt.name, ""), more) if part)
            if opt.flag:
                description = f"{description} Flag: `{opt.flag}`.".strip()
            bounds = {"ge": opt.spec.ge, "gt": opt.spec.gt, "le": opt.spec.le}
            if opt.name in overrides:
                bounds = {}
            if opt.kind is float:
                bounds["allow_inf_nan"] = False
            constraints = {key: value for key, value in bounds.items() if value is not None}
            fields[opt.name] = (annotation, Field(default, description=description, **constraints))
            owners.setdefault(cls, []).append(opt.name)

    @model_validator(mode="after")
    def _checks(self: BaseModel) -> BaseModel:
        for cls, names in owners.items():
            check = getattr(cls, "check", None)
            if check is None:
                continue
            settings = cls(**{key: getattr(self, key) for key in names})
            try:
                settings.check(set(self.model_fields_set) & set(names), str)
            except SettingError as err:
                raise ValueError(str(err)) from None
        return self

    doc = classes[0].__doc__
    model = create_model(name, __base__=base, __doc__=doc, __validators__={"_checks": _checks}, **fields)
    model.__module__ = base.__module__
    model.__settings__ = classes  # type: ignore[attr-defined]  # read by graph/reference.py
    return model
