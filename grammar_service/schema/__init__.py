"""The schema layer: JSON schemas that llguidance cannot enforce as written, made enforceable.

One rule: every finished answer validates against the original schema (jsonschema, format
checking on), or the request ends with a clear error. In `complete` mode (the default):

* `layer.prepare` walks the schema and, per keyword llguidance lacks, rewrites it into an
  equivalent form it enforces (`rewrite`), drops it as an annotation (`formats`), or relaxes it to
  a superset registered for the output check; `fallbacks` are broader relaxations a compile
  retries with when llguidance still refuses; `report` says which keyword went which way;
* `checks.OutputChecks` (per compiled schema) holds the validator and maps output values to the
  schema locations that certainly apply; `monitor.Monitor` (per request) follows the output with
  `scanner.Scanner` and enforces the run-time keywords through the mask rows.

In `strict` mode the schema goes to llguidance unchanged and what it cannot enforce is refused.
"""
