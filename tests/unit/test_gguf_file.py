"""maskwire.gguf_file reads the same metadata and tensors as the `gguf` package's reader."""

from __future__ import annotations

import gguf
import numpy as np

from maskwire.gguf_file import F16, GGUFFile, GGUFTensor
from maskwire.tokenizer import embedded_model_path


def test_matches_gguf_reader() -> None:
    path = embedded_model_path()
    fast = GGUFFile(path)
    ref = gguf.GGUFReader(str(path))
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert fast.metadata[key] == field.contents(), key
    assert [t.name for t in ref.tensors] == list(fast.tensors)
    for t in ref.tensors[:12]:  # Q8_0, Q4_1 and F32 tensors
        expected = gguf.quants.dequantize(t.data, t.tensor_type)
        got = fast.tensors[t.name].dequantize()
        assert got.dtype == np.float32
        assert np.array_equal(got, expected), t.name


def test_f16_tensors_dequantize_to_their_values() -> None:
    values = (np.arange(-6, 6, dtype=np.float16) / 4).reshape(3, 4)
    tensor = GGUFTensor("x", (3, 4), F16, values.view(np.uint8).reshape(3, 8))
    got = tensor.dequantize()
    assert got.dtype == np.float32
    assert np.array_equal(got, values.astype(np.float32))
