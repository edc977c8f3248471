"""The run form: optional fields of one plain type each, and the advanced section (the whole
``PipelineConfig``, with the shipped config's values as its defaults).

The Prefect UI fills a section's fields with the defaults of the parameter's JSON schema. With
the schema's own defaults a person who opens the advanced section would see values no shipped
config has (5 epochs, pool ``retrain-pool``) and empty, required containers; here every default
is the value of the config file the deployments use (``configs/local.yaml``, or the file named by
``RETRAIN_FORM_CONFIG`` when ``prefect deploy`` runs). Validation is ``PipelineConfig``'s own:
these are subclasses that change defaults only.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, Field, create_model, model_validator
from pydantic.fields import FieldInfo

from core.config import PipelineConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
FORM_CONFIG = os.environ.get("RETRAIN_FORM_CONFIG") or str(ROOT / "configs" / "local.yaml")


def _section(annotation: Any) -> type[BaseModel] | None:
    """The model class of a section field (``X`` or ``X | None``), else None."""
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else ()
    candidates = [m for m in members if m is not type(None)] or [annotation]
    found = candidates[0] if len(candidates) == 1 else None
    return found if isinstance(found, type) and issubclass(found, BaseModel) else None


def _absent() -> None:
    return None


def _optional_member(annotation: Any) -> Any:
    """``X`` of an ``X | None`` annotation, else None."""
    if get_origin(annotation) not in (Union, UnionType):
        return None
    members = [m for m in get_args(annotation) if m is not type(None)]
    if len(members) == len(get_args(annotation)):
        return None
    return members[0] if len(members) == 1 else Union[tuple(members)]  # noqa: UP007


def run_form_signature(fn: Callable[..., Any]) -> inspect.Signature:
    """The signature Prefect derives a deployment's parameter schema from (``prefect deploy``
    reads a flow's ``__signature__``), with each optional field of one plain type.

    Python's ``x: int | None = None`` becomes ``anyOf: [integer, null]`` with ``default: null``:
    the UI then shows a type toggle on the field (``Property is type "None"``) and sends the
    null default, which a plain ``integer`` schema would refuse. Here such a parameter is
    ``X`` with a default factory: pydantic writes its plain schema and no default for it, so
    the UI shows the field alone and leaves it out of the run when nobody fills it in (the
    flow's own default, None, then applies). The advanced ``config`` section keeps its toggle:
    its nested fields all have defaults, so without one an untouched form would send a whole
    config. Keyword-only, since a field without a default may now follow one with a default.
    """
    from pydantic import Field

    params = []
    for param in inspect.signature(fn, eval_str=True).parameters.values():
        member = _optional_member(param.annotation)
        if param.default is None and member is not None and _section(member) is None:
            param = param.replace(
                annotation=Annotated[member, Field(default_factory=_absent)],
                default=inspect.Parameter.empty,
            )
        params.append(param.replace(kind=inspect.Parameter.KEYWORD_ONLY))
    return inspect.Signature(params)


def _from_base(cls: type[BaseModel], value: Any) -> Any:
    """A config made in code (the base model, not the form's subclass) is a valid value too."""
    if isinstance(value, BaseModel) and not isinstance(value, cls):
        return value.model_dump()
    return value


def _default(info: FieldInfo, value: Any, validate: bool) -> tuple[Any, FieldInfo]:
    """The annotation (with its bounds) and field of ``info`` with ``value`` as its default
    instead of its own. ``validate``: the default is a section given as a mapping (the
    training section is a dataclass, not a model), which validation turns into the section."""
    described = info.asdict()
    kept = {
        k: v
        for k, v in described["attributes"].items()
        if k not in ("default", "default_factory", "validate_default") and v is not None
    }
    annotation: Any = described["annotation"]
    if described["metadata"]:
        annotation = Annotated[annotation, *described["metadata"]]
    return annotation, Field(default=value, validate_default=validate, **kept)


def with_defaults(
    model: type[BaseModel], values: dict[str, Any], title: str | None = None
) -> type[BaseModel]:
    """A subclass of ``model`` whose defaults are ``values`` (nested sections alike). A section
    type used by several fields (data and output are both a BlobLocation) is named after each
    field, so the form's sections have names a person can tell apart."""
    fields: dict[str, Any] = {}
    sections = [_section(info.annotation) for info in model.model_fields.values()]
    for name, info in model.model_fields.items():
        if name not in values:
            continue
        value, section = values[name], _section(info.annotation)
        if section is not None and isinstance(value, dict):
            shared = sections.count(section) > 1
            sub = with_defaults(section, value, f"{name.capitalize()}Location" if shared else None)
            fields[name] = (sub, Field(default_factory=sub, description=info.description))
        else:
            fields[name] = _default(info, value, isinstance(value, dict))
    return create_model(
        title or model.__name__,
        __base__=model,
        __doc__=model.__doc__,
        __validators__={"_from_base": model_validator(mode="before")(_from_base)},  # type: ignore[dict-item]
        **fields,
    )


if TYPE_CHECKING:
    FormConfig = PipelineConfig
else:
    # Every field, the file's values and the schema's own where the file is silent, so the
    # form shows a default for each (a field whose default is computed shows none otherwise).
    FormConfig = with_defaults(PipelineConfig, load_config(FORM_CONFIG).model_dump())
