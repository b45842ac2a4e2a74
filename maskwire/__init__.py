"""maskwire: grammar-constrained LLM decoding, split into a grammar service, a device worker and a gateway.

This package holds what more than one service needs: the CLI, tokenizers, gRPC plumbing and the
generated stubs (`maskwire.v1`).
"""

__version__ = "0.1.0"
