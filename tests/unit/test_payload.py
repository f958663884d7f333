import pickle
import threading

import pytest

from sparkgpu.errors import PayloadSignatureError, SerializationError
from sparkgpu.rundir.serialization import serialize_payload
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout

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
    rd.create({"job_id": "job-1"}, serialize_payload(fn, args, {}, []), KEY, [])
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


def test_verify_returns_the_checked_bytes_of_every_signed_file(tmp_path):
    rd = RunDir(tmp_path / "job-1")
    rd.create({"job_id": "job-1"}, serialize_payload(plain, (41,), {}, []), KEY, [], {"_hydrate.py": b"X = 1\n"})
    files = RunDir(rd.path).verify(KEY)
    assert sorted(files) == ["_air.py", "_hydrate.py", "payload.pkl", "spec.json"]
    assert files["_air.py"] == rd.air.read_bytes() and files["_hydrate.py"] == b"X = 1\n"
    (rd.path / "_hydrate.py").write_bytes(b"X = 2\n")
    with pytest.raises(PayloadSignatureError, match="modified"):
        RunDir(rd.path, key=KEY).verify()
    (rd.path / "_hydrate.py").unlink()
    with pytest.raises(PayloadSignatureError, match="modified"):
        RunDir(rd.path, key=KEY).verify()


# -- result and error files: signed by the ranks, checked by the client -------------------


class _WritesMarker:
    """Unpickling this creates ``path``: stands for any code a planted pickle could run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def rank_dir(tmp_path) -> tuple[RunDir, RunDir]:
    """A rank's view of a staged run dir (the key its launcher handed it) and the client's."""
    client = stage(tmp_path)
    client.prepare_attempt(0)
    rank = RunDir(client.path)
    rank.load_verified(KEY)
    return rank, client


def test_signed_results_and_errors_round_trip(tmp_path):
    rank, client = rank_dir(tmp_path)
    rank.write_result(0, 0, {"loss": 0.5})
    try:
        raise ValueError("shard 7 is corrupt")
    except ValueError as exc:
        rank.write_error(0, 1, exc)
    assert client.read_result(0, 0) == {"loss": 0.5}
    failure, exc = client.read_error(0, 1)
    assert failure.rank == 1 and failure.exc_type == "ValueError" and "shard 7" in failure.traceback
    assert isinstance(exc, ValueError)
    assert not list(client.file(RunLayout.attempt(0)).rglob(".*.tmp"))


@pytest.mark.parametrize("kind", ["result", "error"])
def test_a_planted_pickle_never_runs_on_the_client(tmp_path, kind):
    _, client = rank_dir(tmp_path)
    marker = tmp_path / "pwned"
    path = client.file(RunLayout.result(0, 0)) if kind == "result" else client.file(RunLayout.error(0, 0))
    path.write_bytes(pickle.dumps(_WritesMarker(marker)))
    read = client.read_result if kind == "result" else client.read_error
    with pytest.raises(PayloadSignatureError, match=f"refusing to unpickle .*the {kind} of rank 0 is not signed"):
        read(0, 0)
    assert not marker.exists()


def test_a_signed_file_that_was_changed_or_moved_is_refused(tmp_path):
    rank, client = rank_dir(tmp_path)
    rank.write_result(0, 0, 1)
    rank.write_result(0, 1, 2)
    data = bytearray(client.file(RunLayout.result(0, 0)).read_bytes())
    data[-33] ^= 1  # the last byte of the pickle, just before the 32-byte MAC
    client.file(RunLayout.result(0, 0)).write_bytes(bytes(data))
    with pytest.raises(PayloadSignatureError, match="does not match its signature"):
        client.read_result(0, 0)
    # Rank 1's genuine result passed off as rank 0's, or as another attempt's: refused too.
    client.file(RunLayout.result(0, 0)).write_bytes(client.file(RunLayout.result(0, 1)).read_bytes())
    with pytest.raises(PayloadSignatureError, match="does not match"):
        client.read_result(0, 0)
    client.prepare_attempt(1)
    client.file(RunLayout.result(1, 1)).write_bytes(client.file(RunLayout.result(0, 1)).read_bytes())
    with pytest.raises(PayloadSignatureError, match="does not match"):
        client.read_result(1, 1)
    assert client.read_result(0, 1) == 2


def test_a_file_signed_with_another_key_is_refused(tmp_path):
    _, client = rank_dir(tmp_path)
    stranger = RunDir(client.path, key=b"x" * 32)
    stranger.write_result(0, 0, "forged")
    with pytest.raises(PayloadSignatureError, match="does not match"):
        client.read_result(0, 0)


def test_a_rank_without_the_key_writes_nothing(tmp_path):
    _, client = rank_dir(tmp_path)
    keyless = RunDir(client.path)
    with pytest.raises(PayloadSignatureError, match="no job key"):
        keyless.write_result(0, 0, 1)
    assert not client.file(RunLayout.result(0, 0)).exists()


def test_a_new_client_process_checks_with_the_key_in_its_keyring(tmp_path):
    from sparkgpu.errors import ConfigurationError
    from sparkgpu.rundir.keyring import save_key

    rank, client = rank_dir(tmp_path)
    rank.write_result(0, 0, "ok")
    with pytest.raises(ConfigurationError, match="no signing key for job job-1"):
        RunDir(client.path).read_result(0, 0)
    save_key("job-1", KEY)
    assert RunDir(client.path).read_result(0, 0) == "ok"
