"""GGUFFile: files written by gguf.GGUFWriter read back; corrupt files refused cleanly."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest

from dynalm.core.quant import dequantize
from dynalm.errors import ModelFormatError, ModelNotFound, UnsupportedModel
from dynalm.models.gguf_file import GGUFFile

T = gguf.GGMLQuantizationType
V = gguf.GGUFValueType

RNG = np.random.default_rng(0)
F32 = RNG.standard_normal((3, 64)).astype(np.float32)
F16 = RNG.standard_normal((2, 3, 32)).astype(np.float16)
Q8_SRC = RNG.standard_normal((4, 64)).astype(np.float32)
Q4_SRC = RNG.standard_normal((8, 96)).astype(np.float32)
Q8 = gguf.quants.quantize(Q8_SRC, T.Q8_0)
Q4 = gguf.quants.quantize(Q4_SRC, T.Q4_1)


def write_model(path: Path, alignment: int | None = None) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_string("general.name", "tiny ü")
    w.add_uint32("llama.block_count", 2)
    w.add_int64("test.int64", -(2**40))
    w.add_uint8("test.uint8", 255)
    w.add_float32("test.float32", 0.5)
    w.add_float64("test.float64", 1e-300)
    w.add_bool("test.bool", True)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "ü", ""])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.25, 3.0])
    w.add_key_value("test.u16s", [1, 65535], V.ARRAY, sub_type=V.UINT16)
    w.add_array("test.nested", [[1, 2, 3], [4]])
    w.add_array("test.bools", [True, False, True])
    w.add_tensor("f32", F32)
    w.add_tensor("f16", F16)
    w.add_tensor("q8", Q8, raw_dtype=T.Q8_0)
    w.add_tensor("q4", Q4, raw_dtype=T.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "tiny.gguf")


def info_fields(data: bytes, name: str) -> dict[str, int]:
    """Byte offsets of a tensor-info record's fields, found by its name."""
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded)
    n_dims_at = at + 8 + len(encoded)
    (n_dims,) = struct.unpack_from("<I", data, n_dims_at)
    type_at = n_dims_at + 4 + 8 * n_dims
    return {"name": at + 8, "n_dims": n_dims_at, "ne0": n_dims_at + 4, "type": type_at}


def patched(model: Path, at: int, fmt: str, value: int | bytes) -> Path:
    data = bytearray(model.read_bytes())
    struct.pack_into(fmt, data, at, value)
    out = model.with_name("patched.gguf")
    out.write_bytes(bytes(data))
    return out


def test_reads_metadata_of_every_kind(model: Path) -> None:
    with GGUFFile(model) as f:
        assert f.version == 3
        assert f.file_size == model.stat().st_size
        assert f.architecture == "llama"
        m = f.metadata
        assert m["general.name"] == "tiny ü"
        assert m["llama.block_count"] == 2 and type(m["llama.block_count"]) is int
        assert m["test.int64"] == -(2**40)
        assert m["test.uint8"] == 255
        assert m["test.float32"] == 0.5 and type(m["test.float32"]) is float
        assert m["test.float64"] == 1e-300
        assert m["test.bool"] is True
        assert m["tokenizer.ggml.tokens"] == ["<s>", "a", "ü", ""]
        scores = m["tokenizer.ggml.scores"]
        assert scores.dtype == np.float32
        np.testing.assert_array_equal(scores, [0.0, -1.5, 2.25, 3.0])
        assert m["test.u16s"].dtype == np.uint16 and m["test.u16s"].tolist() == [1, 65535]
        nested = m["test.nested"]
        assert [a.tolist() for a in nested] == [[1, 2, 3], [4]]
        assert m["test.bools"].dtype == bool and m["test.bools"].tolist() == [True, False, True]


def test_tensors_shapes_bytes_and_round_trip(model: Path) -> None:
    with GGUFFile(model) as f:
        assert list(f.tensors) == ["f32", "f16", "q8", "q4"]
        assert f.tensors["f32"].shape == (3, 64)
        assert f.tensors["f16"].shape == (2, 3, 32)
        assert f.tensors["q8"].shape == (4, 64)
        assert f.tensors["q4"].shape == (8, 96)
        assert f.tensors["q4"].ggml_type == T.Q4_1
        assert f.tensors["q4"].nbytes == Q4.nbytes
        for info in f.tensors.values():
            assert info.offset % 32 == 0

        np.testing.assert_array_equal(f.raw("f32"), F32.view(np.uint8))
        np.testing.assert_array_equal(f.raw("f16"), F16.view(np.uint8))
        np.testing.assert_array_equal(f.raw("q8"), Q8)
        np.testing.assert_array_equal(f.raw("q4"), Q4)
        assert f.raw("q4").shape == (8, 60)
        assert not f.raw("q4").flags.writeable

        np.testing.assert_array_equal(dequantize(f.raw("f32"), T.F32, 64), F32)
        np.testing.assert_array_equal(dequantize(f.raw("f16"), T.F16, 32), F16)
        for name, src, qtype in [("q8", Q8_SRC, T.Q8_0), ("q4", Q4_SRC, T.Q4_1)]:
            ours = dequantize(f.raw(name), qtype, src.shape[-1])
            np.testing.assert_array_equal(ours, gguf.quants.dequantize(f.raw(name), qtype))
            assert np.abs(ours - src).max() < 0.3
        with pytest.raises(ModelFormatError, match="no tensor named 'nope'"):
            f.raw("nope")
        kept = f.raw("q8")
    # views outlive close(); the file object itself refuses further reads
    np.testing.assert_array_equal(kept, Q8)
    with pytest.raises(ValueError, match="closed"):
        f.raw("q8")


def test_read_rows_in_the_order_asked_repeats_included(model: Path) -> None:
    """``read_rows`` (pread, each distinct row once) gives the rows asked for, in the order
    asked, repeated where ids repeat (an encoder step's positions and token types)."""
    ids = np.array([3, 0, 3, 3, 1, 0], np.int64)
    with GGUFFile(model) as f:
        np.testing.assert_array_equal(f.read_rows("q8", ids), Q8[ids])
        np.testing.assert_array_equal(
            f.read_rows("f32", ids[ids < 3]), F32.view(np.uint8)[ids[ids < 3]]
        )
        assert f.read_rows("q8", np.array([], np.int64)).shape == (0, Q8.shape[1])
        with pytest.raises(ValueError, match="row ids outside tensor 'q8'"):
            f.read_rows("q8", np.array([4]))


def test_custom_alignment(tmp_path: Path) -> None:
    with GGUFFile(write_model(tmp_path / "a.gguf", alignment=64)) as f:
        assert f.metadata["general.alignment"] == 64
        assert all(t.offset % 64 == 0 for t in f.tensors.values())
        np.testing.assert_array_equal(f.raw("q4"), Q4)


def test_version_2_is_read(model: Path) -> None:
    with GGUFFile(patched(model, 4, "<I", 2)) as f:
        assert f.version == 2
        np.testing.assert_array_equal(f.raw("q8"), Q8)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="nothing.gguf: no such file"):
        GGUFFile(tmp_path / "nothing.gguf")
    with pytest.raises(ModelFormatError, match="is a directory"):
        GGUFFile(tmp_path)


def test_not_gguf(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello, this is not a model\n")
    with pytest.raises(ModelFormatError, match=r"notes.txt is not a GGUF file \(magic b'hell'\)"):
        GGUFFile(text)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelFormatError, match="is empty"):
        GGUFFile(empty)


def test_bad_magic(model: Path) -> None:
    with pytest.raises(ModelFormatError, match=r"not a GGUF file \(magic b'GGML'\)"):
        GGUFFile(patched(model, 0, "<4s", b"GGML"))


@pytest.mark.parametrize(
    ("version", "message"),
    [
        (1, "unsupported GGUF version 1"),
        (4, "unsupported GGUF version 4"),
        (3 << 24, "big-endian GGUF files are not supported"),
    ],
)
def test_unsupported_version(model: Path, version: int, message: str) -> None:
    with pytest.raises(ModelFormatError, match=message):
        GGUFFile(patched(model, 4, "<I", version))


def test_every_truncation_is_a_format_error(model: Path) -> None:
    data = model.read_bytes()
    with GGUFFile(model) as f:
        end = max(t.offset + t.nbytes for t in f.tensors.values())
    cut = model.with_name("cut.gguf")
    cut.write_bytes(data[:end])  # trailing padding after the last tensor is optional
    GGUFFile(cut).close()
    for n in range(1, end):
        cut.write_bytes(data[:n])
        with pytest.raises(ModelFormatError) as e:
            GGUFFile(cut)
        message = str(e.value)
        assert "\n" not in message and str(cut) in message, message
        assert "truncated" in message, message
    cut.write_bytes(data[: end - 1])
    with pytest.raises(ModelFormatError, match=r"tensor 'q4' needs bytes \d+\.\.\d+ but the file"):
        GGUFFile(cut)


def test_absurd_lengths_do_not_allocate(model: Path) -> None:
    data = model.read_bytes()
    name_len_at = data.index(b"general.name") + len("general.name") + 4
    with pytest.raises(
        ModelFormatError,
        match="truncated: metadata .general.name. at offset \\d+ needs 4611686018427387904 bytes",
    ):
        GGUFFile(patched(model, name_len_at, "<Q", 2**62))
    tokens_count_at = data.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 8
    with pytest.raises(ModelFormatError, match="truncated: 1152921504606846976 strings"):
        GGUFFile(patched(model, tokens_count_at, "<Q", 2**60))
    with pytest.raises(ModelFormatError, match="truncated: .* metadata entries"):
        GGUFFile(patched(model, 16, "<Q", 2**63))
    with pytest.raises(ModelFormatError, match="truncated: .* tensor infos"):
        GGUFFile(patched(model, 8, "<Q", 2**40))


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.IQ3_S, T.TQ1_0], ids=lambda t: t.name)
def test_unsupported_tensor_type_is_named(model: Path, qtype: T) -> None:
    """Formats without a table row (the other I-quants, the ternary ones) are refused at
    load, naming the tensor and its format."""
    at = info_fields(model.read_bytes(), "q8")["type"]
    with pytest.raises(UnsupportedModel, match=f"tensor 'q8' has type {qtype.name}, which DynaLM"):
        GGUFFile(patched(model, at, "<I", qtype))
    with pytest.raises(UnsupportedModel, match="tensor 'q8' has type 999,"):
        GGUFFile(patched(model, at, "<I", 999))


def test_bad_tensor_infos(model: Path) -> None:
    data = model.read_bytes()
    q8 = info_fields(data, "q8")
    with pytest.raises(ModelFormatError, match="tensor 'q8' has 5 dimensions"):
        GGUFFile(patched(model, q8["n_dims"], "<I", 5))
    with pytest.raises(ModelFormatError, match="tensor 'q8' has invalid dimensions"):
        GGUFFile(patched(model, q8["ne0"] + 8, "<Q", 0))
    with pytest.raises(ModelFormatError, match="tensor 'q8' has invalid dimensions"):
        GGUFFile(patched(model, q8["ne0"] + 8, "<Q", 2**64 - 1))
    with pytest.raises(ModelFormatError, match="rows of 48 elements, not a multiple of the q8_0"):
        GGUFFile(patched(model, q8["ne0"], "<Q", 48))
    with pytest.raises(ModelFormatError, match="tensor 'q8' has offset \\d+, not a multiple"):
        GGUFFile(patched(model, q8["type"] + 4, "<Q", 33))
    q4_name = info_fields(data, "q4")["name"]
    with pytest.raises(ModelFormatError, match="duplicate tensor name 'q8'"):
        GGUFFile(patched(model, q4_name, "<2s", b"q8"))


def test_bad_alignment_and_unknown_value_type(tmp_path: Path) -> None:
    model = write_model(tmp_path / "a.gguf", alignment=64)
    data = model.read_bytes()
    value_at = data.index(b"general.alignment") + len("general.alignment") + 4
    with pytest.raises(ModelFormatError, match="general.alignment = 48 is not a power of two"):
        GGUFFile(patched(model, value_at, "<I", 48))
    with pytest.raises(ModelFormatError, match="'general.alignment' has unknown value type 77"):
        GGUFFile(patched(model, value_at - 4, "<I", 77))


def test_missing_architecture(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m.gguf")
    data = model.read_bytes()
    at = data.index(b"general.architecture")
    f = GGUFFile(patched(model, at, "<20s", b"general.architecturX"))
    with pytest.raises(ModelFormatError, match="no general.architecture"):
        _ = f.architecture
