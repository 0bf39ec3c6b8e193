import struct

import numpy as np
import pytest

from rwkv_clip.data.recordio import (
    MAGIC,
    DataError,
    IRHeader,
    RecordIOReader,
    RecordIOWriter,
    encode_record,
    pack,
    read_index,
    scan_records,
    unpack,
)

M = struct.pack("<I", MAGIC)


def lrec(cflag, n):
    return struct.pack("<I", (cflag << 29) | n)


def test_encode_simple_record_bytes():
    # 5 bytes -> magic, length word (cflag 0), data, 3 bytes of zero padding
    assert encode_record(b"hello") == M + lrec(0, 5) + b"hello" + b"\0\0\0"
    assert encode_record(b"abcd") == M + lrec(0, 4) + b"abcd"
    assert encode_record(b"") == M + lrec(0, 0)


def test_encode_splits_aligned_magic_like_dmlc():
    payload = b"ABCD" + M + b"EFGHIJ"
    # aligned magic at 4: part1 (cflag 1, 4 bytes), part2 (cflag 3, 6 bytes + pad)
    want = M + lrec(1, 4) + b"ABCD" + M + lrec(3, 6) + b"EFGHIJ" + b"\0\0"
    assert encode_record(payload) == want
    # magic at the very start and twice in a row -> empty parts
    payload = M + M + b"xy"
    want = M + lrec(1, 0) + M + lrec(2, 0) + M + lrec(3, 2) + b"xy\0\0"
    assert encode_record(payload) == want
    # unaligned magic is not split
    payload = b"AB" + M + b"CD"
    assert encode_record(payload) == M + lrec(0, 8) + payload
    # unaligned magic at the end is not split either
    payload = b"ABCDE" + M
    assert encode_record(payload)[:8] == M + lrec(0, 9)


def test_pack_unpack_header():
    labels = np.arange(231, dtype=np.float32)
    p = pack(IRHeader(0, 0.0, 7, 3), labels, b"IMG")
    flag, lab, id_, id2 = struct.unpack_from("<IfQQ", p)
    assert (flag, lab, id_, id2) == (231, 0.0, 7, 3)
    h, l2, img = unpack(p)
    assert h.flag == 231 and h.id == 7 and h.id2 == 3
    np.testing.assert_array_equal(l2, labels)
    assert img == b"IMG"
    h, l3, img = unpack(pack(IRHeader(0, 2.5, 1, 0), None, b"xyz"))
    assert h.flag == 0 and h.label == 2.5 and l3 is None and img == b"xyz"


def _payloads():
    rng = np.random.default_rng(0)
    out = [b"", b"a", b"abcd", M, M * 3, b"xy" + M + b"zz" + M, bytes(rng.integers(0, 256, 1001,
                                                                                    dtype=np.uint8))]
    # random payloads with the magic planted at aligned and unaligned places
    for _k in range(20):
        b = bytearray(rng.integers(0, 256, int(rng.integers(8, 300)), dtype=np.uint8).tobytes())
        for _ in range(3):
            pos = int(rng.integers(0, len(b) - 4))
            b[pos:pos + 4] = M
        out.append(bytes(b))
    return out


def test_round_trip_with_magic_payloads(tmp_path):
    payloads = _payloads()
    with RecordIOWriter(str(tmp_path / "x.rec"), str(tmp_path / "x.idx")) as w:
        for i, p in enumerate(payloads):
            w.write(i * 10, p)
    r = RecordIOReader(str(tmp_path / "x"))
    assert len(r) == len(payloads)
    for i, p in enumerate(payloads):
        assert r.read_key(i * 10) == p
        assert r.read_idx(i) == p
    # sequential scan without the index gives the same payloads
    assert [p for _, p in scan_records(str(tmp_path / "x.rec"))] == payloads
    # .idx lines are key<TAB>offset and offsets point at magics
    lines = (tmp_path / "x.idx").read_text().splitlines()
    raw = (tmp_path / "x.rec").read_bytes()
    assert len(lines) == len(payloads)
    for line in lines:
        k, off = line.split("\t")
        assert raw[int(off):int(off) + 4] == M
    assert len(raw) % 4 == 0


def test_image_record_round_trip(tmp_path):
    labels = np.arange(231) * 200 % 49408
    with RecordIOWriter(str(tmp_path / "a.rec"), str(tmp_path / "a.idx")) as w:
        w.write_image_record(0, labels.astype(np.float32), b"\xff\xd8" + M + b"\xff\xd9")
    k, h, lab, img = RecordIOReader(str(tmp_path / "a")).read_item(0)
    assert k == 0 and h.flag == 231
    np.testing.assert_array_equal(lab.astype(np.int64), labels)
    assert img == b"\xff\xd8" + M + b"\xff\xd9"


def test_writer_aborts_on_exception(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with RecordIOWriter(str(tmp_path / "a.rec"), str(tmp_path / "a.idx")) as w:
            w.write(0, b"abc")
            raise ZeroDivisionError  # an error inside the with block
    assert not list(tmp_path.iterdir())


def test_read_index_errors(tmp_path):
    p = tmp_path / "x.idx"
    p.write_text("0\t0\n1\tabc\n")
    with pytest.raises(DataError, match="malformed index line 2"):
        read_index(str(p))
    p.write_text("")
    with pytest.raises(DataError, match="empty"):
        read_index(str(p))
    p.write_text("0\t0\n1\t400\n")
    with pytest.raises(DataError, match="past the end") as e:
        read_index(str(p), rec_size=100)
    assert e.value.record == 1 and str(p) in str(e.value)
    with pytest.raises(DataError, match="not found"):
        read_index(str(tmp_path / "nope.idx"))
