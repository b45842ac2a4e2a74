"""The enforcement report: for one schema, how each keyword is enforced (`SchemaReport` proto),
and `Refused`, for a keyword the service cannot enforce at all."""

from __future__ import annotations

from dataclasses import dataclass, field

from maskwire.v1 import common_pb2

GRAMMAR = common_pb2.ENFORCEMENT_GRAMMAR
REWRITTEN = common_pb2.ENFORCEMENT_REWRITTEN
RUNTIME = common_pb2.ENFORCEMENT_RUNTIME
ANNOTATION = common_pb2.ENFORCEMENT_ANNOTATION

# Entries kept per report: a schema with thousands of rewritten places still gets a bounded answer
# (the count of the rest is in `omitted`).
MAX_ENTRIES = 256


class Refused(Exception):
    """A keyword at a location of the schema that cannot be enforced: the schema is refused."""

    def __init__(self, keyword: str, location: str, why: str) -> None:
        super().__init__(f"'{keyword}' at {location}: {why}")
        self.keyword = keyword
        self.location = location


@dataclass
class Report:
    """Built by the layer while it walks a schema."""

    mode: int
    validated: bool = False
    grammar: set[str] = field(default_factory=set)
    entries: list[tuple[str, str, int, str]] = field(default_factory=list)

    def add(self, keyword: str, location: str, how: int, detail: str) -> None:
        self.entries.append((keyword, location, how, detail))

    def keywords(self, how: int) -> set[str]:
        return {k for k, _, h, _ in self.entries if h == how}

    def to_proto(self) -> common_pb2.SchemaReport:
        msg = common_pb2.SchemaReport(
            mode=self.mode,  # type: ignore[arg-type]
            grammar_keywords=sorted(self.grammar),
            validated=self.validated,
            omitted=max(0, len(self.entries) - MAX_ENTRIES),
        )
        for keyword, location, how, detail in self.entries[:MAX_ENTRIES]:
            msg.keywords.add(
                keyword=keyword,
                location=location,
                enforcement=how,
                detail=detail,
            )
        return msg
