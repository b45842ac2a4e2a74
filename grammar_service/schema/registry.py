"""A `referencing` registry that holds the JSON Schema metaschemas and never retrieves anything.

jsonschema's validators default to a registry that fetches a `$ref` to an unknown `http(s)://`
URI over the network (with a deprecation warning). Code here that validates schemas, or values
against schemas, gives the validator `OFFLINE` instead: a reference to anything but a metaschema
(or a resource inside the schema itself) is unresolvable, and no connection is ever made.
"""

from __future__ import annotations

from typing import Any

from jsonschema_specifications import REGISTRY as METASCHEMAS
from referencing import Registry, Resource
from referencing.exceptions import NoSuchResource


# (referencing's attrs classes are typed without their fields: hence the ignores)
def _refuse(uri: str) -> Resource[Any]:
    raise NoSuchResource(ref=uri)  # type: ignore[call-arg]


OFFLINE: Registry[Any] = Registry(retrieve=_refuse).with_resources(  # type: ignore[call-arg]
    METASCHEMAS.items()
)
