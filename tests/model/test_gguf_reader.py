"""The loader's GGUF reader parses what ``gguf.GGUFReader`` parses: the same fields (keys, types,
offsets, parts byte for byte, data indices), the same tensors, and the same decoded values, while
the long arrays (vocabulary, merges, scores, token types) are built only when read."""

from __future__ import annotations

import gguf
import numpy as np

from pagedllm.model.gguf_reader import FastGGUFReader, LazyArrayParts, field_value, read_metadata
from pagedllm.model.loader import default_model_path


def _parts(field: gguf.ReaderField) -> list[tuple[str, bytes]]:
    return [(str(part.dtype), part.tobytes()) for part in field.parts]


def test_fields_and_tensors_are_the_stock_readers() -> None:
    path = default_model_path()
    fast, stock = FastGGUFReader(path), gguf.GGUFReader(path)
    assert list(fast.fields) == list(stock.fields)
    lazy = [k for k, f in fast.fields.items() if isinstance(f.parts, LazyArrayParts)]
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"} <= set(lazy)
    for key, field in fast.fields.items():
        want = stock.fields[key]
        assert (field.offset, field.name, field.types) == (want.offset, want.name, want.types), key
        assert list(field.data) == list(want.data), key
        # Decoded from the bytes (lazy arrays) equals decoded from the parts.
        assert field_value(field) == field_value(want), key
        assert read_metadata(fast, key) == read_metadata(stock, key), key
    for key in lazy:  # the parts themselves, once built
        assert _parts(fast.fields[key]) == _parts(stock.fields[key]), key
    described = [(t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in fast.tensors]
    assert described == [
        (t.name, t.tensor_type, list(t.shape), t.data_offset, t.n_bytes) for t in stock.tensors
    ]
    for mine, theirs in zip(fast.tensors, stock.tensors, strict=True):
        assert np.array_equal(np.asarray(mine.data[:8]), np.asarray(theirs.data[:8])), mine.name
    # The contents API that transformers uses, on a lazy field.
    tokens = fast.fields["tokenizer.ggml.tokens"]
    assert tokens.contents(3) == stock.fields["tokenizer.ggml.tokens"].contents(3)


def test_a_short_array_is_parsed_at_once(tmp_path: object) -> None:
    path = f"{tmp_path}/short.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("test.short", [1, 2, 3])
    writer.add_array("test.long", [f"s{i}" for i in range(200)])
    writer.add_array("test.floats", [float(i) / 4 for i in range(100)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fast = FastGGUFReader(path)
    assert not isinstance(fast.fields["test.short"].parts, LazyArrayParts)
    assert isinstance(fast.fields["test.long"].parts, LazyArrayParts)
    assert read_metadata(fast, "test.short") == [1, 2, 3]
    assert read_metadata(fast, "test.long") == [f"s{i}" for i in range(200)]
    assert read_metadata(fast, "test.floats") == [float(i) / 4 for i in range(100)]
