"""The run directory: everything a worker needs, and everything it leaves behind.

:class:`RunDir` is one run dir on this machine: paths, the signed payload, the signed rank
outputs. Its files and their names are :mod:`sparkgpu.rundir.layout`'s.

With a staging store (``SPARKGPU_STAGING_ROOT`` an fsspec URL) the same layout is mirrored at
``<url>/<job_id>/`` and each Spark node works on a scratch copy (:mod:`sparkgpu.launch.staging.mirror`);
checkpoints then live on the store only.

Everyone who can write the staging root can write here, so nothing read from it is trusted
unsigned: workers run only a payload whose signature matches the job's key, and the client
unpickles only result and error files that the job's ranks signed with that key. The key
itself never touches the run dir.

Every file a reader may see as complete is written to a temporary name and renamed
(:mod:`sparkgpu._util.files`). How the payload, the results and the errors are pickled is
:mod:`sparkgpu.rundir.serialization`'s; the entrypoint's text is :mod:`sparkgpu.rundir.entrypoint_template`'s.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import time
from pathlib import Path
from collections.abc import Iterable
from typing import Any

import cloudpickle

from sparkgpu._util.files import atomic_write_bytes, atomic_writer, temporary_name
from sparkgpu.rundir.keyring import derive_key
from sparkgpu.errors import ConfigurationError, PayloadSignatureError, RankFailure
from sparkgpu.rundir.signature import sign_payload, verifier_source, verify_payload
from sparkgpu.rundir.control import seal, unseal
from sparkgpu.rundir.key_handover import KEY_DIR_ENV, RANK_KEY_FILE
from sparkgpu.rundir.entrypoint_template import AIR_TEMPLATE
from sparkgpu.rundir.states import NodeExit, RankExit
from sparkgpu.rundir.layout import RunLayout
from sparkgpu.rundir.serialization import deserialize_error, dump_result, serialize_error, unpack_payload

__all__ = ["RunDir", "PRIVATE_DIR", "PRIVATE_FILE", "PRIVATE_UMASK"]

_SIGNED_MAGIC = b"sparkgpu-signed-v1\n"

#: A run dir is its user's alone (the staging root may be shared): its folders 0700, its files
#: 0600. The agent and the ranks work under umask 077 (:data:`PRIVATE_UMASK`) for the same.
PRIVATE_DIR, PRIVATE_FILE, PRIVATE_UMASK = 0o700, 0o600, 0o077


class _MacWriter:
    """A file that feeds everything written to it into a MAC as well."""

    def __init__(self, f, mac):
        self._f, self._mac = f, mac

    def write(self, data) -> int:
        self._mac.update(data)
        return self._f.write(data)


class RunDir:
    """One run directory on this machine: its paths (named by :class:`RunLayout`), the
    signed payload and the signed rank outputs.

    Args:
        path: The run directory.
        key: The job's signing key, when this process has it (client, agent, rank). Staging
            and :meth:`load_verified` set it too. Ranks sign their result and error files
            with it; the client checks them with it (or with the key in its keyring).
    """

    #: Seconds before a run dir without its key looks in the keyring again.
    KEYRING_RETRY_SECONDS = 30.0

    def __init__(self, path: str | os.PathLike, key: bytes | None = None):
        self.path = Path(path)
        self.key = key
        self._started: dict[int, dict[int, dict]] = {}  # attempt -> node -> its genuine start marker
        self._keyring_missed_at: float | None = None

    def __repr__(self) -> str:  # never shows the key
        return f"RunDir({str(self.path)!r})"

    # -- paths (names from RunLayout) ---------------------------------------------------
    @property
    def job_id(self) -> str:
        return self.path.name

    @property
    def air(self) -> Path:
        return self.path / RunLayout.ENTRYPOINT

    @property
    def spec_file(self) -> Path:
        return self.path / RunLayout.SPEC

    @property
    def payload_file(self) -> Path:
        return self.path / RunLayout.PAYLOAD

    @property
    def signature_file(self) -> Path:
        return self.path / RunLayout.SIGNATURE

    @property
    def state_file(self) -> Path:
        return self.path / RunLayout.STATE

    @property
    def checkpoints(self) -> Path:
        return self.path / RunLayout.CHECKPOINTS

    @property
    def cancel_request_file(self) -> Path:
        return self.path / RunLayout.CANCEL_REQUEST

    def file(self, rel: str) -> Path:
        """The file named ``rel`` by :class:`RunLayout`: ``run_dir.file(RunLayout.result(attempt, rank))``.

        The job's own files have properties here (:attr:`spec_file`, :attr:`state_file`, ...);
        an attempt's are named by :class:`RunLayout` and found through this.
        """
        return self.path / rel

    def logs_dir(self, attempt: int) -> Path:
        return self.path / RunLayout.logs(attempt)

    # -- control files (sealed under the job key, sparkgpu.rundir.control) ---------------
    def _keyring_key(self) -> bytes:
        """The job key from this user's keyring (the client's), kept on this run dir.

        Raises:
            ConfigurationError: the job was launched from another machine or user.
        """
        from sparkgpu.rundir.keyring import load_key

        self.key = load_key(self.job_id)
        return self.key

    def _known_key(self) -> bytes | None:
        """The job key: held, else from the keyring, looked up again at most every
        ``KEYRING_RETRY_SECONDS`` while it is missing (a poll loop must not read the keyring each time)."""
        if self.key:
            return self.key
        now = time.monotonic()
        if self._keyring_missed_at is not None and now - self._keyring_missed_at < self.KEYRING_RETRY_SECONDS:
            return None
        try:
            return self._keyring_key()
        except ConfigurationError:
            self._keyring_missed_at = now
            return None

    def _place(self, path: Path) -> str:
        return path.relative_to(self.path).as_posix()

    def write_control(self, path: Path, body: bytes) -> None:
        """Writes a control file of this run dir, sealed under the job key (:func:`seal`).

        Raises:
            PayloadSignatureError: this process has no key for the job.
        """
        key = self._known_key()
        if not key:
            raise PayloadSignatureError(f"no job key to sign {self._place(path)} of {self.job_id} with")
        atomic_write_bytes(path, seal(key, self._place(path), body), mode=PRIVATE_FILE)

    def create_control(self, path: Path, body: bytes) -> bool:
        """Creates a sealed control file that may be written once only (a node's start marker);
        False when it exists. It never exists half-written: the sealed bytes are linked into place.

        Raises:
            PayloadSignatureError: this process has no key for the job.
        """
        key = self._known_key()
        if not key:
            raise PayloadSignatureError(f"no job key to sign {self._place(path)} of {self.job_id} with")
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = Path(temporary_name(path))
        atomic_write_bytes(temporary, seal(key, self._place(path), body), mode=PRIVATE_FILE)
        try:
            os.link(temporary, path)
        except FileExistsError:
            return False
        finally:
            temporary.unlink()
        return True

    def read_control(self, path: Path) -> bytes | None:
        """The body of a control file of this run dir, or ``None`` when it is absent or does not
        verify under the job key (then it is reported once, as :func:`unseal` says)."""
        try:
            sealed = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return unseal(self._known_key(), self._place(path), sealed)

    def read_control_json(self, path: Path) -> Any:
        """:meth:`read_control`, parsed as JSON; ``None`` when absent, forged or not JSON."""
        body = self.read_control(path)
        try:
            return None if body is None else json.loads(body)
        except ValueError:
            return None

    def node_markers(self, attempt: int, kind: str) -> dict[int, Path]:
        """The attempt's Spark node markers of one ``kind``, by node."""
        folder = self.file(RunLayout.spark(attempt))
        found = {}
        for path in folder.iterdir() if folder.is_dir() else ():
            node = RunLayout.node_marker_node(path.name, kind)
            if node is not None:
                found[node] = path
        return dict(sorted(found.items()))

    def write_control_copies(self, attempt: int, files: dict[str, bytes], have: dict[str, bytes]) -> None:
        """Writes the attempt's control files received from elsewhere (the store, node 0), as they
        came: still sealed, checked when read. Only the names of
        :meth:`RunLayout.control_files`, and only those that changed since ``have``, which it updates.
        """
        wanted = set(RunLayout.control_files(attempt))
        for rel, data in files.items():
            if rel in wanted and have.get(rel) != data:
                path = self.file(rel)
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(path, data, fsync=False)
                have[rel] = data

    def nodes_without_end(self, attempt: int, ended: Iterable[int] | None = None) -> list[int]:
        """Spark nodes of the attempt that started and have not written their (genuine) end marker yet;
        ``ended``: the nodes whose end markers the caller read already (else they are read here)."""
        if ended is None:
            ended = {node for node, path in self.node_markers(attempt, "ended").items() if self.read_control(path)}
        return sorted(set(self.started_nodes(attempt)) - set(ended))

    def started_nodes(self, attempt: int) -> dict[int, dict]:
        """The attempt's Spark nodes whose start marker is genuine (sealed under the job key), with
        what each marker says; a planted marker is no started node. Markers are written once, so
        each is read until it verifies, then kept."""
        seen = self._started.setdefault(attempt, {})
        for node, path in self.node_markers(attempt, "started").items():
            if node not in seen:
                info = self.read_control_json(path)
                if isinstance(info, dict):
                    seen[node] = info
        return dict(sorted(seen.items()))

    def node_exit_files(self, attempt: int) -> dict[int, Path]:
        """The attempt's node exit files (written by each node's agent), by node."""
        found = {}
        for path in self._attempt_files(attempt):
            node = RunLayout.node_exits_node(path.name)
            if node is not None:
                found[node] = path
        return found

    # -- writing (client) ---------------------------------------------------------------
    def create(
        self,
        spec_dict: dict,
        payload: bytes,
        key: bytes,
        sys_path: list[str],
        extra_files: dict[str, bytes] | None = None,
    ) -> None:
        """Creates the run dir: the entrypoint, spec, payload and extra files, then the signature
        over all of them. ("Staging" in this package means the environment's upload and the
        staging store that mirrors run dirs; writing a run dir is creating it.)"""
        extra_files = dict(extra_files or {})
        if extra_files:
            spec_dict = {**spec_dict, "signed_files": sorted(extra_files)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.mkdir(mode=PRIVATE_DIR, exist_ok=False)  # under a shared root, the user's alone
        self.checkpoints.mkdir(mode=PRIVATE_DIR)
        air = AIR_TEMPLATE.format(
            job_id=spec_dict["job_id"],
            sys_path=sys_path,
            verifier=verifier_source(),
            env_report=RunLayout.env_report("{attempt}", "{rank}"),
            rank_log=RunLayout.rank_log("{attempt}", "{rank}"),
            hydrate=RunLayout.HYDRATE,
            spec=RunLayout.SPEC,
            key_dir_env=KEY_DIR_ENV,
            rank_key_file=RANK_KEY_FILE,
        ).encode()
        spec = json.dumps(spec_dict, indent=2, sort_keys=True).encode()
        atomic_write_bytes(self.air, air, mode=PRIVATE_FILE)
        atomic_write_bytes(self.spec_file, spec, mode=PRIVATE_FILE)
        atomic_write_bytes(self.payload_file, payload, mode=PRIVATE_FILE)
        for name, data in extra_files.items():
            atomic_write_bytes(self.path / name, data, mode=PRIVATE_FILE)
        extras = [extra_files[name] for name in sorted(extra_files)]
        signature = sign_payload(key, [air, spec, payload, *extras]).encode()
        atomic_write_bytes(self.signature_file, signature, mode=PRIVATE_FILE)
        self.key = key

    def prepare_attempt(self, attempt: int) -> None:
        self.path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)  # a node's scratch copy may not exist yet
        for folder in (RunLayout.logs(attempt), RunLayout.results(attempt)):
            path = self.path
            for part in Path(folder).parts:  # each level private (mkdir's parents= would not be)
                path = path / part
                path.mkdir(mode=PRIVATE_DIR, exist_ok=True)

    # -- reading (worker) --------------------------------------------------------------
    def verify(self, key: bytes | None = None) -> dict[str, bytes]:
        """Checks the signature over every signed file, ``_air.py`` included (:func:`verify_payload`).

        Each file is read once: callers run and unpickle exactly the bytes returned, never a
        file that may have changed on the staging store since.

        Args:
            key: The job's key; :attr:`key` by default.

        Returns:
            File name -> verified content: ``_air.py``, ``spec.json``, ``payload.pkl`` and the
            spec's ``signed_files``.

        Raises:
            PayloadSignatureError: no key, no signature, or the files were changed.
        """
        key = key if key is not None else self.key
        if not key:
            raise PayloadSignatureError(
                f"refusing to run {self.path}: the worker was handed no job key; "
                "only payloads launched by sparkgpu with their job's key run"
            )
        files = verify_payload(self.path, key)
        if files is None:
            raise PayloadSignatureError(
                f"refusing to run {self.path}: the payload is unsigned or was modified after it was "
                "staged (signature mismatch); launch the job again from the client, and check who "
                "else can write its staging root"
            )
        return files

    def load_verified(self, key: bytes | None) -> tuple[dict, dict]:
        """Returns ``(spec_dict, payload_parts)`` after checking the signature.

        The key is kept (:attr:`key`) to sign this process's result or error, also when the
        check fails: the client then reads why the rank refused.

        Raises:
            PayloadSignatureError: no key, no signature, or the files were changed.
        """
        self.key = key or None
        files = self.verify(key)
        return json.loads(files["spec.json"]), pickle.loads(files["payload.pkl"])

    @staticmethod
    def unpack(parts: dict) -> tuple[Any, tuple, dict, list]:
        """The function, arguments and callbacks of the verified payload parts (see :func:`unpack_payload`)."""
        return unpack_payload(parts)

    # -- results (signed by the ranks, checked by the client) ---------------------------
    def _output_mac(self, kind: str, attempt: int, rank: int, *, reading: bool) -> hmac.HMAC:
        if self.key:
            key = self.key
        elif reading:
            key = self._keyring_key()
        else:
            raise PayloadSignatureError(
                f"rank {rank} of {self.job_id} has no job key to sign its {kind} with (its launcher handed none); "
                "only ranks launched by sparkgpu report results"
            )
        # A key of its own for outputs, and the file's place in the job bound into the MAC, so
        # a signed file is never accepted as a payload signature or as another rank's output.
        output_key = derive_key(key, "rank outputs")
        mac = hmac.new(output_key, digestmod=hashlib.sha256)
        mac.update(f"{self.job_id}\0{attempt}\0{rank}\0{kind}\0".encode())
        return mac

    def _write_signed(self, path: Path, kind: str, attempt: int, rank: int, dump) -> None:
        mac = self._output_mac(kind, attempt, rank, reading=False)
        with atomic_writer(path) as f:
            f.write(_SIGNED_MAGIC)
            dump(_MacWriter(f, mac))
            f.write(mac.digest())

    def _read_signed(self, path: Path, kind: str, attempt: int, rank: int) -> memoryview:
        data = path.read_bytes()
        mac = self._output_mac(kind, attempt, rank, reading=True)
        size = len(data) - len(_SIGNED_MAGIC) - mac.digest_size
        if size < 0 or not data.startswith(_SIGNED_MAGIC):
            problem = "is not signed"
        else:
            body = memoryview(data)[len(_SIGNED_MAGIC) : len(_SIGNED_MAGIC) + size]
            mac.update(body)
            if hmac.compare_digest(mac.digest(), data[-mac.digest_size :]):
                return body
            problem = "does not match its signature"
        raise PayloadSignatureError(
            f"refusing to unpickle {path}: the {kind} of rank {rank} {problem}, so it was not written by this "
            f"job's ranks (or was changed afterwards) and could run arbitrary code here; check who else can "
            f"write the staging root ({self.path.parent}) and run the job again"
        )

    def write_result(self, attempt: int, rank: int, value: Any) -> None:
        self._write_signed(
            self.file(RunLayout.result(attempt, rank)), "result", attempt, rank, lambda f: dump_result(value, f, rank)
        )

    def write_error(self, attempt: int, rank: int, exc: BaseException) -> None:
        data = serialize_error(rank, exc)
        self._write_signed(self.file(RunLayout.error(attempt, rank)), "error", attempt, rank, lambda f: f.write(data))

    def read_result(self, attempt: int, rank: int) -> Any:
        """Rank ``rank``'s return value.

        Raises:
            PayloadSignatureError: the file is unsigned or not signed with the job's key.
            ConfigurationError: this process has no key for the job.
        """
        return cloudpickle.loads(self.read_result_payload(attempt, rank))

    def read_result_payload(self, attempt: int, rank: int) -> memoryview:
        """Rank ``rank``'s return value as its checked pickle, not yet unpickled: unpickling a
        model imports its libraries (torch, transformers), which only whoever uses it needs.

        Raises:
            PayloadSignatureError: the file is unsigned or not signed with the job's key.
            ConfigurationError: this process has no key for the job.
        """
        return self._read_signed(self.file(RunLayout.result(attempt, rank)), "result", attempt, rank)

    def read_error(self, attempt: int, rank: int) -> tuple[RankFailure, BaseException | None]:
        """Rank ``rank``'s failure, and its exception when the class exists here.

        Raises:
            PayloadSignatureError: the file is unsigned or not signed with the job's key.
            ConfigurationError: this process has no key for the job.
        """
        return deserialize_error(self._read_signed(self.file(RunLayout.error(attempt, rank)), "error", attempt, rank))

    def _attempt_files(self, attempt: int) -> list[Path]:
        folder = self.file(RunLayout.attempt(attempt))
        return sorted(folder.iterdir()) if folder.is_dir() else []

    def read_env_reports(self, attempt: int) -> dict[int, dict]:
        """Per rank, what rehydrating the shipped environment cost (:class:`~sparkgpu.env.hydrate.HydrationReport` as a dict)."""
        reports = {}
        for path in self._attempt_files(attempt):
            rank = RunLayout.env_report_rank(path.name)
            if rank is not None:
                reports[rank] = json.loads(path.read_text())
        return dict(sorted(reports.items()))

    def read_node_exits(self, attempt: int) -> dict[int, RankExit]:
        """Exit information per global rank, merged over the attempt's nodes' :class:`NodeExit` records."""
        exits: dict[int, RankExit] = {}
        for path in self.node_exit_files(attempt).values():
            record = self.read_control_json(path)
            if record is not None:
                exits.update(NodeExit.from_json(record).failures)
        return exits

    def log_tail(self, attempt: int, rank: int, lines: int = 20) -> str:
        try:
            with open(self.file(RunLayout.rank_log(attempt, rank)), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                text = f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(_tail_lines(text.splitlines(), lines))


def _tail_lines(lines: list[str], keep: int) -> list[str]:
    """The last ``keep`` lines of a rank's log; where the rank died with Python's fatal-error dump
    (a segfault, an abort), the dump without its other threads' stacks, after what the rank
    printed before it: the crashing thread's stack and the rank's last words are what tell why."""
    fatal = next((i for i in range(len(lines) - 1, -1, -1) if "Fatal Python error:" in lines[i]), None)
    if fatal is None:
        return lines[-keep:]
    dump: list[str] = []
    other_thread = False
    for line in lines[fatal:]:
        if "(most recent call first):" in line:
            other_thread = "Current thread 0x" not in line
        elif not line.strip():
            other_thread = False
        if not other_thread and (line.strip() or not dump or dump[-1].strip()):
            dump.append(line)
    before = lines[max(0, fatal - max(1, keep - len(dump))) : fatal]
    return before + dump
