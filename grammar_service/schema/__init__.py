"""The schema layer: JSON schemas that llguidance cannot enforce as written, made enforceable.

One rule: every finished answer validates against the original schema (jsonschema, format
checking on), or the request ends with a clear error. In `complete` mode (the default) a schema
goes through these stages before the grammar compiler sees it:

* `layer.prepare` walks it and, per keyword llguidance lacks, rewrites it into an equivalent
  form llguidance enforces (`rewrite`), treats it as an annotation where the spec allows
  (`formats`), or relaxes it to a superset and checks it on the output (`checks`, `monitor`);
* `report` says which keyword went which way (Compile and the gateway pass it on).

In `strict` mode the schema goes to llguidance unchanged and what it cannot enforce is refused.
"""
