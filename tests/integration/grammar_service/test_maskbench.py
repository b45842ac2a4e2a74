"""MaskBench instances through `Session`, one token per step, in both schema modes.

* `strict` mode: the service accepts and rejects exactly where llguidance in-process does (same
  options: default compact layout, `lenient` as MaskBench's llguidance runs use), and every valid
  instance of a compilable schema is accepted except the listed llguidance limitations.
* `complete` mode (the default, no `lenient`): more schemas compile, no invalid instance is
  accepted, every accepted instance validates against its schema (jsonschema, format checking
  on), every valid one is accepted except the same llguidance limitations, and no token of an
  accepted instance was masked off on the way (the output check never cuts a valid path).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import llguidance

from grammar_service.schema.checks import new_validator
from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer
from maskwire.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc
from tests.integration.grammar_service.client import SessionClient, allowed, masks, row, text_tokens

STRICT = common_pb2.JsonOptions(lenient=True, schema_mode=common_pb2.SCHEMA_MODE_STRICT)
COMPLETE = common_pb2.JsonOptions(schema_mode=common_pb2.SCHEMA_MODE_COMPLETE)
LOCAL_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
}
# Valid instances llguidance itself rejects (so the service must too), and why.
LLGUIDANCE_REJECTS_VALID = {
    "maskbench_MCPspec/CallToolResult.json": "properties must come in schema order",
    "maskbench_MCPspec/CreateMessageRequest.json": "properties must come in schema order",
    "maskbench_MCPspec/GetPromptResult.json": "properties must come in schema order",
    "maskbench_MCPspec/ServerRequest.json": "properties must come in schema order",
    "maskbench_Synthesized/draft2019_09_valid_const_id27_subschema1_not_2.json": "const 0 does not admit 0.0",
    "maskbench_Synthesized/draft2019_09_valid_const_id30_subschema1_not_2.json": "const 1 does not admit 1.0",
}
# Schemas (with instances) llguidance still refuses after the schema layer, and why.
COMPLETE_COMPILE_ERRORS = {
    "maskbench_Handwritten/notnames10.json": "circular references with sibling keys",
    "maskbench_Handwritten/notnames9.json": "circular references with sibling keys",
    "maskbench_Handwritten/testwp9.json": "circular references with sibling keys",
}
BATCH = 96


@dataclass
class Instance:
    schema_id: str
    schema: Any
    valid: bool
    data: Any
    tokens: list[int]
    local_reject_at: int | None = None  # index of the first token llguidance rejects
    local_accepting: bool = False
    service_reject_at: int | None = None
    service_accepting: bool = False
    masks_ok: list[bool] = field(default_factory=list)


def _local(tok: Tokenizer, schema: str, tokens: list[int]) -> tuple[int | None, bool]:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=LOCAL_OPTIONS)  # type: ignore[arg-type]
    m = llguidance.LLMatcher(tok.ll, grammar, log_level=0)
    for i, t in enumerate(tokens):
        if not m.consume_token(t):
            return i, False
    return None, bool(m.is_accepting())


def _compile_all(
    root: Path, channel: grpc.Channel, tok: Tokenizer, options: common_pb2.JsonOptions
) -> tuple[list[tuple[Instance, str]], dict[str, str]]:
    """Every instance with the grammar id of its schema, and the schemas that did not compile."""
    stub = grammar_pb2_grpc.GrammarServiceStub(channel)
    instances: list[tuple[Instance, str]] = []
    refused: dict[str, str] = {}
    for path in sorted((root / "instances").glob("*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            lines = [json.loads(line) for line in f]
        for entry in lines:
            schema = (root / entry["schema_file"]).read_text()
            try:
                compiled = stub.Compile(
                    grammar_pb2.CompileRequest(
                        constraint=common_pb2.Constraint(json_schema=schema, json_options=options),
                        tokenizer=tok.fingerprint.to_proto(),
                    )
                )
            except grpc.RpcError as e:
                err = RpcError.from_call_error(e)  # type: ignore[arg-type]
                assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.violations
                refused[entry["id"]] = err.message
                continue
            for t in entry["tests"]:
                toks = text_tokens(tok, json.dumps(t["data"], ensure_ascii=False))
                inst = Instance(entry["id"], json.loads(schema), t["valid"], t["data"], toks)
                instances.append((inst, compiled.grammar_id))
    return instances, refused


def _run(channel: grpc.Channel, tok: Tokenizer, instances: list[tuple[Instance, str]]) -> None:
    client = SessionClient(channel)
    for start in range(0, len(instances), BATCH):
        _run_batch(client, tok, instances[start : start + BATCH], start)
    client.end()


def test_strict_mode_accepts_and_rejects_like_llguidance(
    testdata: Path, gs_channel: grpc.Channel, smollm: Tokenizer
) -> None:
    root = testdata / "maskbench"
    instances, refused = _compile_all(root, gs_channel, smollm, STRICT)
    assert len(instances) > 450
    for inst, _ in instances:
        inst.local_reject_at, inst.local_accepting = _local(
            smollm, json.dumps(inst.schema), inst.tokens
        )
    for schema_id in refused:
        local = (root / "schemas" / f"{schema_id}").read_text()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(local, defaults=LOCAL_OPTIONS)  # type: ignore[arg-type]
        assert llguidance.LLMatcher.validate_grammar(grammar, smollm.ll), schema_id
    _run(gs_channel, smollm, instances)

    for inst, _ in instances:
        assert inst.service_reject_at == inst.local_reject_at, inst.schema_id
        assert inst.service_accepting == inst.local_accepting, inst.schema_id
        if inst.local_accepting:
            assert all(inst.masks_ok), f"{inst.schema_id}: a consumed token was masked off"
    valid_rejected = {i.schema_id for i, _ in instances if i.valid and not i.service_accepting}
    assert valid_rejected == set(LLGUIDANCE_REJECTS_VALID)
    invalid = [i for i, _ in instances if not i.valid]
    assert sum(not i.service_accepting for i in invalid) >= len(invalid) - 3
    assert len(refused) < 8


def test_complete_mode_covers_more_and_accepts_nothing_invalid(
    testdata: Path, gs_channel: grpc.Channel, smollm: Tokenizer
) -> None:
    root = testdata / "maskbench"
    instances, refused = _compile_all(root, gs_channel, smollm, COMPLETE)
    _, refused_strict = _compile_all(
        root, gs_channel, smollm, common_pb2.JsonOptions(schema_mode=common_pb2.SCHEMA_MODE_STRICT)
    )
    assert set(refused) == set(COMPLETE_COMPILE_ERRORS)
    assert len(refused_strict) > 4 * len(refused)  # 132 of the 166 schemas without `lenient`
    _run(gs_channel, smollm, instances)

    for inst, _ in instances:
        if inst.service_accepting:
            assert new_validator(inst.schema).is_valid(inst.data)
            assert inst.valid, f"{inst.schema_id}: an invalid instance was accepted"
            assert all(inst.masks_ok), f"{inst.schema_id}: a consumed token was masked off"
    valid_rejected = {i.schema_id for i, _ in instances if i.valid and not i.service_accepting}
    assert valid_rejected == set(LLGUIDANCE_REJECTS_VALID)


def _run_batch(
    client: SessionClient, tok: Tokenizer, batch: list[tuple[Instance, str]], base: int
) -> None:
    ids = [f"m{base + k}" for k in range(len(batch))]
    for rid, (_, gid) in zip(ids, batch, strict=True):
        opened = client.open(rid, tok, grammar_id=gid)
        assert not opened.HasField("error"), opened.error
    live = list(range(len(batch)))
    pos = 0
    while live:
        rows = [row(ids[k], pos, batch[k][0].tokens[pos - 1 : pos] if pos else []) for k in live]
        res = client.step(rows)
        got = masks(res)
        cursor = 0
        still = []
        for k, r in zip(live, res.rows, strict=True):
            inst = batch[k][0]
            if r.status == grammar_pb2.ROW_STATUS_ERROR:
                inst.service_reject_at = pos - 1
                assert client.close(ids[k]).found
                continue
            assert r.status == grammar_pb2.ROW_STATUS_OK and r.mask_rows == 1, r
            mask = got[cursor]
            cursor += 1
            if pos < len(inst.tokens):
                inst.masks_ok.append(allowed(mask, inst.tokens[pos]))
                still.append(k)
            else:
                inst.service_accepting = r.accepting
                assert client.close(ids[k]).found
        live = still
        pos += 1
