import threading

import pytest

from sparkgpu.errors import PayloadSignatureError, SerializationError
from sparkgpu.launch.payload import RunDir, serialize_payload

KEY = b"k" * 32
_LOCK = threading.Lock()


def uses_global_lock():
    with _LOCK:
        return 1


def plain(x):
    return x + 1


def test_unpicklable_argument_is_named():
    with pytest.raises(SerializationError) as err:
        serialize_payload(plain, (1, threading.Lock()), {}, [])
    assert "positional argument 1" in str(err.value) and "lock" in str(err.value)
    with pytest.raises(SerializationError, match="keyword argument 'conn'"):
        serialize_payload(plain, (), {"conn": threading.Lock()}, [])


def test_function_closing_over_an_unpicklable_object_names_it():
    lock = threading.Lock()

    def closure():
        return lock

    with pytest.raises(SerializationError, match="closure variable 'lock'"):
        serialize_payload(closure, (), {}, [])


def stage(tmp_path, fn=plain, args=(41,)):
    rd = RunDir(tmp_path / "job-1")
    rd.stage({"job_id": "job-1"}, serialize_payload(fn, args, {}, []), KEY, [])
    return rd


def test_signed_payload_round_trips(tmp_path):
    rd = stage(tmp_path)
    spec, parts = rd.load_verified(KEY)
    fn, args, kwargs, callbacks = RunDir.unpack(parts)
    assert spec == {"job_id": "job-1"} and fn(*args) == 42 and callbacks == []
    assert KEY.hex() not in "".join(p.read_bytes().hex() for p in rd.path.rglob("*") if p.is_file())


@pytest.mark.parametrize("victim", ["payload_file", "air", "spec_file"])
def test_tampered_payload_is_refused(tmp_path, victim):
    rd = stage(tmp_path)
    path = getattr(rd, victim)
    path.write_bytes(path.read_bytes() + b"\n# injected")
    with pytest.raises(PayloadSignatureError, match="modified"):
        rd.load_verified(KEY)


def test_unsigned_or_keyless_payload_is_refused(tmp_path):
    rd = stage(tmp_path)
    with pytest.raises(PayloadSignatureError, match="no job key"):
        rd.load_verified(None)
    rd.signature_file.unlink()
    with pytest.raises(PayloadSignatureError):
        rd.load_verified(KEY)
    with pytest.raises(PayloadSignatureError):
        stage(tmp_path / "other").load_verified(b"x" * 32)


def test_stage_refuses_to_reuse_a_run_dir(tmp_path):
    stage(tmp_path)
    with pytest.raises(FileExistsError):
        stage(tmp_path)
