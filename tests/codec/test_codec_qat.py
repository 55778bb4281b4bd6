"""The qat method: standard gzip streams that decode anywhere, with or without libqatzip / ISA-L.

No QAT device exists here, so the ctypes binding is driven through ``fake_qatzip.c``: a small C
library with libqatzip's ABI (built with gcc) that behaves like QATzip on a host without hardware.
"""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvshrink.codec import Codec, decode, encode, qat_status, read_header
from kvshrink.codec import qat as qat_module
from kvshrink.codec.dtypes import ArrayKind
from kvshrink.codec.frame import GZIP, pack_header, parse_header

HERE = Path(__file__).resolve().parent


def gzip_streams(blob: bytes) -> list[bytes]:
    header, table = parse_header(memoryview(blob))
    return [blob[o:o + s] for o, s, c in zip(table.offsets.ravel(), table.sizes.ravel(), table.codings.ravel())
            if c == GZIP]


def test_qat_streams_are_plain_gzip(real_chunks):
    blob = encode(real_chunks[0], method="qat")
    header = read_header(blob)
    assert header.method == "qat"
    streams = gzip_streams(blob)
    assert streams, "the exponent streams must be compressed"
    size = header.block_elems
    for s in streams[:-1]:
        assert len(gzip.decompress(s)) == size  # the standard library reads them as they are


def test_multi_member_gzip_streams_decode(real_chunks):
    """QATzip writes one gzip member per 64 KiB; a frame holding such streams decodes exactly."""
    data = real_chunks[0].reshape(-1).view(np.uint8)[:300_000]
    members = b"".join(gzip.compress(data[i:i + 65536].tobytes(), 1) for i in range(0, data.size, 65536))
    kind = ArrayKind("numpy", "|u1", (data.size,), 1)
    blob = pack_header(kind, "qat", "none", 1, data.size, [xxhash.xxh3_64_intdigest(data)], [[GZIP]],
                       [[len(members)]]) + members
    assert decode(blob).tobytes() == data.tobytes()


def run_python(code: str, env_extra: dict[str, str] | None = None) -> str:
    import os

    env = {**os.environ, **(env_extra or {})}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_zlib_only_host_reads_isal_frames_and_back(real_chunks, tmp_path):
    pytest.importorskip("isal")
    kv = np.ascontiguousarray(real_chunks[1][:, :8])
    np.save(tmp_path / "kv.npy", kv)
    (tmp_path / "isal.kvs").write_bytes(encode(kv, method="qat"))
    out = run_python(f"""
import sys; sys.modules["isal"] = None  # this host has no ISA-L
import numpy as np
from kvshrink.codec import decode, encode, qat_status
kv = np.load({str(tmp_path / 'kv.npy')!r})
assert decode(open({str(tmp_path / 'isal.kvs')!r}, 'rb').read()).tobytes() == kv.tobytes()
open({str(tmp_path / 'zlib.kvs')!r}, 'wb').write(encode(kv, method='qat'))
print(qat_status())
""")
    assert "software deflate: zlib" in out
    assert decode((tmp_path / "zlib.kvs").read_bytes()).tobytes() == kv.tobytes()


def test_status_without_library():
    out = run_python("""
from kvshrink.codec import encode, qat_status
import numpy as np
encode(np.ones(100000, np.float32), method="qat")
print(qat_status())
""", {"KVSHRINK_QATZIP_LIB": "/nonexistent/libqatzip.so"})
    assert "libqatzip not found" in out and "last qat-method stream: software deflate" in out


@pytest.fixture(scope="module")
def fake_libqatzip(tmp_path_factory) -> Path:
    if shutil.which("gcc") is None or not Path("/usr/include/zlib.h").exists():
        pytest.skip("needs gcc and zlib headers to build the stand-in libqatzip")
    lib = tmp_path_factory.mktemp("qat") / "libqatzip.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(HERE / "fake_qatzip.c"), "-lz"], check=True)
    return lib


def test_ctypes_binding_through_a_libqatzip_abi(real_chunks, fake_libqatzip, tmp_path):
    kv = real_chunks[2]
    np.save(tmp_path / "kv.npy", kv)
    out = run_python(f"""
import numpy as np
from kvshrink.codec import Codec, qat_status
kv = np.load({str(tmp_path / 'kv.npy')!r})
with Codec(method="qat", threads=2, block_size=512 << 10) as codec:
    blob = codec.encode(kv)
    assert codec.decode(blob).tobytes() == kv.tobytes()
open({str(tmp_path / 'qat.kvs')!r}, "wb").write(blob)
print(qat_status())
""", {"KVSHRINK_QATZIP_LIB": str(fake_libqatzip)})
    assert f"libqatzip loaded from {fake_libqatzip}" in out
    assert "libqatzip (QATzip software fallback)" in out
    blob = (tmp_path / "qat.kvs").read_bytes()
    assert decode(blob).tobytes() == kv.tobytes()  # written "on the QAT host", read here
    assert any(s.count(b"\x1f\x8b\x08") > 1 for s in gzip_streams(blob)), "expected multi-member streams"


def test_status_line_names_the_paths():
    status = qat_status()
    assert "libqatzip" in status and "software deflate" in status
    assert qat_module.software_deflate_name() in ("isal", "zlib")


def test_qat_levels_are_validated():
    from kvshrink.codec import CodecArgumentError

    with pytest.raises(CodecArgumentError, match="level"):
        Codec(method="qat", level=10)
    with pytest.raises(CodecArgumentError, match="level"):
        encode(np.zeros(4), method="qat", level=0)
