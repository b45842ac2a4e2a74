"""JSON-Schema-Test-Suite (draft2020-12) through Compile and Session, in both schema modes.

Replicates llguidance's own harness (`json_schema_test_suite` + `llg_test_utils`): the schema as
`%json` with llguidance's default layout (flexible whitespace, "," and ":"), each instance
serialized compactly (serde_json style), tokenized, fed in one Step; the case passes when the
grammar never rejects a token and is accepting at the end. A compile error is `skip_compile` when
its message says the feature is unimplemented, else `compile_error_valid` /
`compile_error_all_invalid`.

* `strict` mode reproduces llguidance's baseline case by case (the service adds nothing).
* `complete` mode (the default) is the baseline plus the schema layer's changes, every one listed
  in `schema_layer_accounting.json` with the new outcome and why; and the rule holds: every
  instance the service accepts validates against the schema as sent (jsonschema, format checking
  on). Where the suite calls such an instance invalid, the accounting says so (`false_positive`,
  why `validator_accepts`: the suite is stricter than the validator the rule names).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest

from grammar_service.schema.checks import new_validator
from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer
from maskwire.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc
from tests.integration.grammar_service.client import SessionClient, row, text_tokens

ACCOUNTING = Path(__file__).with_name("schema_layer_accounting.json")


def harness_options(mode: int) -> common_pb2.JsonOptions:
    return common_pb2.JsonOptions(
        whitespace_flexible=True, item_separator=",", key_separator=":", schema_mode=mode
    )


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


def _baseline(root: Path) -> dict[str, str]:
    data = json.loads(
        (root / "llguidance_baseline" / "expected_json_schema_test_suite.json").read_text()
    )["draft2020-12"]
    return {
        f"{f} / {g} / {t}": cat
        for f, groups in data.items()
        for g, tests in groups.items()
        for t, cat in tests.items()
    }


def run_suite(
    root: Path, channel: grpc.Channel, tok: Tokenizer, mode: int
) -> tuple[dict[str, str], dict[str, tuple[Any, Any]]]:
    """Every case's outcome, and (schema, instance) of each accepted instance."""
    stub = grammar_pb2_grpc.GrammarServiceStub(channel)
    client = SessionClient(channel)
    fingerprint = tok.fingerprint.to_proto()
    got: dict[str, str] = {}
    accepted: dict[str, tuple[Any, Any]] = {}
    for key, group in _load(root):
        constraint = common_pb2.Constraint(
            json_schema=json.dumps(group["schema"]), json_options=harness_options(mode)
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
        assert compiled.schema_report.mode == mode
        # All instances of the group are rows of one Step, each fed its whole token sequence.
        rows = []
        for i, t in enumerate(group["tests"]):
            opened = client.open(f"c{i}", tok, grammar_id=compiled.grammar_id)
            assert not opened.HasField("error"), opened.error
            toks = text_tokens(
                tok, json.dumps(t["data"], ensure_ascii=False, separators=(",", ":"))
            )
            rows.append(row(f"c{i}", len(toks), toks))
        res = client.step(rows)
        for i, (t, r) in enumerate(zip(group["tests"], res.rows, strict=True)):
            assert r.status in (grammar_pb2.ROW_STATUS_OK, grammar_pb2.ROW_STATUS_ERROR), r
            ok = r.status == grammar_pb2.ROW_STATUS_OK and r.accepting
            if ok:
                accepted[ids[i]] = (group["schema"], t["data"])
            if ok == t["valid"]:
                got[ids[i]] = "pass"
            else:
                got[ids[i]] = "false_negative" if t["valid"] else "false_positive"
            assert client.close(f"c{i}").found
    client.end()
    return got, accepted


def test_strict_mode_matches_llguidance_baseline(
    testdata: Path, gs_channel: grpc.Channel, smollm: Tokenizer
) -> None:
    root = testdata / "json-schema-test-suite"
    expected = _baseline(root)
    got, _ = run_suite(root, gs_channel, smollm, common_pb2.SCHEMA_MODE_STRICT)
    assert set(got) == set(expected), "test suite and baseline disagree on the case list"
    mismatches = {
        k: f"baseline {expected[k]}, service {got[k]}" for k in expected if got[k] != expected[k]
    }
    assert not mismatches, "\n".join(f"{k}: {v}" for k, v in sorted(mismatches.items()))


def test_complete_mode_is_the_baseline_plus_the_listed_changes(
    testdata: Path, gs_channel: grpc.Channel, smollm: Tokenizer
) -> None:
    root = testdata / "json-schema-test-suite"
    baseline = _baseline(root)
    accounting = json.loads(ACCOUNTING.read_text())
    changes: dict[str, dict[str, str]] = accounting["cases"]
    got, accepted = run_suite(root, gs_channel, smollm, common_pb2.SCHEMA_MODE_COMPLETE)
    assert set(got) == set(baseline)

    # The rule: whatever the service accepts validates against the schema as sent.
    for case_id, (schema, data) in accepted.items():
        assert new_validator(schema).is_valid(data), case_id

    expected = {k: changes[k]["now"] if k in changes else v for k, v in baseline.items()}
    mismatches = {
        k: f"expected {expected[k]}, service {got[k]}" for k in got if got[k] != expected[k]
    }
    assert not mismatches, "\n".join(f"{k}: {v}" for k, v in sorted(mismatches.items()))
    for case_id, change in changes.items():
        assert change["baseline"] == baseline[case_id], case_id
        assert change["now"] != baseline[case_id], f"{case_id}: listed but unchanged"
        assert change["why"] in accounting["reasons"], case_id
        if change["now"] == "false_positive":
            assert change["why"] == "validator_accepts", case_id
    # The headline numbers (docs/benchmarks.md quotes them).
    counts = Counter(got.values())
    base = Counter(baseline.values())
    assert counts["pass"] == accounting["totals"]["pass"] > base["pass"]


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
