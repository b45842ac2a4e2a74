"""JSON-Schema-Test-Suite (draft2020-12) through Compile and Session reproduces llguidance's baseline.

Replicates llguidance's own harness (`json_schema_test_suite` + `llg_test_utils`): the schema as
`%json` with llguidance's default layout (flexible whitespace, "," and ":"), each instance
serialized compactly (serde_json style), tokenized, fed token by token; the case passes when the
grammar never rejects a token and is accepting at the end. A compile error is `skip_compile` when
its message says the feature is unimplemented, else `compile_error_valid` /
`compile_error_all_invalid`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer
from maskwire.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc
from tests.integration.grammar_service.client import SessionClient, row, text_tokens

HARNESS_OPTIONS = common_pb2.JsonOptions(
    whitespace_flexible=True, item_separator=",", key_separator=":"
)
# Cases that cannot reproduce the baseline through this service, with the reason. (None today.)
KNOWN_DIFFERENCES: dict[str, str] = {}


def _load(root: Path) -> list[tuple[str, dict[str, Any]]]:
    tests = root / "tests" / "draft2020-12"
    files = [(p.stem, p) for p in sorted(tests.glob("*.json"))]
    files += [
        (f"optional/format/{p.stem}", p)
        for p in sorted((tests / "optional" / "format").glob("*.json"))
    ]
    return [(key, group) for key, path in files for group in json.loads(path.read_text())]


def _compile_category(err: RpcError, group: dict[str, Any]) -> str:
    if "Unimplemented keys" in err.message or "not supported" in err.message:
        return "skip_compile"
    return (
        "compile_error_valid"
        if any(t["valid"] for t in group["tests"])
        else "compile_error_all_invalid"
    )


def test_json_schema_test_suite_matches_llguidance_baseline(
    testdata: Path, gs_channel: grpc.Channel, smollm: Tokenizer
) -> None:
    root = testdata / "json-schema-test-suite"
    baseline = json.loads(
        (root / "llguidance_baseline" / "expected_json_schema_test_suite.json").read_text()
    )["draft2020-12"]
    stub = grammar_pb2_grpc.GrammarServiceStub(gs_channel)
    client = SessionClient(gs_channel)
    fingerprint = smollm.fingerprint.to_proto()
    got: dict[str, str] = {}
    compiled_ok = 0
    for key, group in _load(root):
        constraint = common_pb2.Constraint(
            json_schema=json.dumps(group["schema"]), json_options=HARNESS_OPTIONS
        )
        ids = [f"{key} / {group['description']} / {t['description']}" for t in group["tests"]]
        try:
            compiled = stub.Compile(
                grammar_pb2.CompileRequest(constraint=constraint, tokenizer=fingerprint)
            )
        except grpc.RpcError as e:
            err = RpcError.from_call_error(e)  # type: ignore[arg-type]
            assert err.code == grpc.StatusCode.INVALID_ARGUMENT, err.message
            assert err.violations and err.violations[0][0] == "constraint.json_schema"
            for case_id in ids:
                got[case_id] = _compile_category(err, group)
            continue
        compiled_ok += 1
        # All instances of the group are rows of one Step, each fed its whole token sequence.
        rows = []
        for i, t in enumerate(group["tests"]):
            rid = f"c{i}"
            opened = client.open(rid, smollm, grammar_id=compiled.grammar_id)
            assert not opened.HasField("error"), opened.error
            toks = text_tokens(
                smollm, json.dumps(t["data"], ensure_ascii=False, separators=(",", ":"))
            )
            rows.append(row(rid, len(toks), toks))
        res = client.step(rows)
        for i, (t, r) in enumerate(zip(group["tests"], res.rows, strict=True)):
            assert r.status in (grammar_pb2.ROW_STATUS_OK, grammar_pb2.ROW_STATUS_ERROR), r
            accepted = r.status == grammar_pb2.ROW_STATUS_OK and r.accepting
            if accepted == t["valid"]:
                got[ids[i]] = "pass"
            else:
                got[ids[i]] = "false_negative" if t["valid"] else "false_positive"
            assert client.close(f"c{i}").found
    client.end()

    expected = {
        f"{f} / {g} / {t}": cat
        for f, groups in baseline.items()
        for g, tests in groups.items()
        for t, cat in tests.items()
    }
    assert set(got) == set(expected), "test suite and baseline disagree on the case list"
    assert compiled_ok > 150
    mismatches = {
        k: f"baseline {expected[k]}, service {got[k]}"
        for k in expected
        if got[k] != expected[k] and k not in KNOWN_DIFFERENCES
    }
    assert not mismatches, "\n".join(f"{k}: {v}" for k, v in sorted(mismatches.items()))
    stale = [k for k in KNOWN_DIFFERENCES if got.get(k) == expected.get(k)]
    assert not stale, f"listed as known differences but now match: {stale}"


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
