"""The base of every CRD model: camelCase on the wire, snake_case in Python, nothing unknown.

Kubernetes objects are camelCase JSON; Python code reads better in snake_case. One
alias generator bridges the two so a field is declared once. ``extra="forbid"``
makes a typo in a manifest an error that names the field instead of a silently
ignored key (the API server prunes unknown fields, so only hand-built dicts and
tests ever hit it).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "weightsync.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

DNS_LABEL = 63
DNS_NAME = 253
IMAGE_LENGTH = 512
ARG_LENGTH = 4096
MAX_ARGS = 128

Arg = Annotated[str, Field(max_length=ARG_LENGTH)]
"""One command-line argument; bounded so CEL cost estimates stay finite."""
ReplicaName = Annotated[str, Field(max_length=DNS_NAME)]


class Model(BaseModel):
    """Base model: camelCase aliases, unknown keys rejected, validated on assignment."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        use_enum_values=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The JSON-ready dict as the API server stores it (camelCase, unset optionals left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def rules(*items: tuple[str, str] | tuple[str, str, str]) -> dict[str, Any]:
    """``x-kubernetes-validations`` for a Field or model: (rule, message[, fieldPath])."""
    out = []
    for item in items:
        rule: dict[str, str] = {"rule": item[0], "message": item[1]}
        if len(item) == 3:
            rule["fieldPath"] = item[2]
        out.append(rule)
    return {"x-kubernetes-validations": out}


def immutable(description: str, **kwargs: Any) -> Any:
    """A Field whose value may be set once: the API server rejects a change with a message naming it."""
    extra = dict(kwargs.pop("json_schema_extra", {}) or {})
    extra.update(rules(("self == oldSelf", "is immutable; delete and re-create the RLJob to change it")))
    return Field(description=description, json_schema_extra=extra, **kwargs)
