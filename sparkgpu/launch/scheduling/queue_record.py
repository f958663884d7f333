"""What both job queues (this host's GPU queue, a Spark cluster's queue) hold for a waiting job."""

from __future__ import annotations

import dataclasses
import enum
import json
import typing
from typing import Any, ClassVar, TypeVar

from sparkgpu.spec.priority import Priority

__all__ = ["QueueRecord"]

_R = TypeVar("_R", bound="QueueRecord")


@dataclasses.dataclass(frozen=True)
class QueueRecord:
    """A job in line for GPUs: higher classes first, then the earliest ``order``, then the job id.

    Subclasses add their fields; every field is a ``str``, ``int``, ``float``, :class:`Priority`
    or other ``str``-valued enum, so a record is one flat JSON object.

    Attributes:
        job_id: The job.
        priority: Its class.
        gpus: How many GPUs it needs.
        order: Unix time it first asked; earlier goes first within a class.
    """

    job_id: str
    priority: Priority
    gpus: int
    order: float

    # A field's key in the JSON where it differs from the field's name: the key stays what
    # every version writes, so that clients of two versions share one queue.
    json_keys: ClassVar[dict[str, str]] = {}

    def sort_key(self) -> tuple[int, float, str]:
        return (-self.priority.rank, self.order, self.job_id)

    def to_json(self) -> str:
        return json.dumps(
            {
                self.json_keys.get(field.name, field.name): (
                    value.value if isinstance(value := getattr(self, field.name), enum.Enum) else value
                )
                for field in dataclasses.fields(self)
            }
        )

    @classmethod
    def from_json(cls: type[_R], text: str | bytes) -> _R:
        """The record in ``text``; ``ValueError``, ``KeyError`` or ``TypeError`` when it is none."""
        data = json.loads(text)
        types = typing.get_type_hints(cls)
        return cls(
            **{
                field.name: _parse(types[field.name], data[cls.json_keys.get(field.name, field.name)])
                for field in dataclasses.fields(cls)
            }
        )


def _parse(kind: Any, value: Any) -> Any:
    # Priority.parse also takes the classes' other spellings; every other type (str, int, float,
    # a str-valued enum) is its own constructor.
    return Priority.parse(value) if kind is Priority else kind(value)
