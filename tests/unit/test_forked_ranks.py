"""Spares forked by a node's agent become ranks as ``python -c <_air.py text> RUN_DIR`` would.

Each case runs in a process of its own, single-threaded as the agent is when it forks its
spares (a test runner's worker has threads of its own).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

_HARNESS = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    from sparkgpu.config import settings
    from sparkgpu.launch.node.forked_ranks import ForkedRank, RankSpares

    assert settings().hf_resume  # read and cached here, as the agent does before it forks

    text = sys.stdin.read()
    out = Path(sys.argv[1])
    spares = RankSpares(int(sys.argv[2]), text, "<air>", out, b"k" * 32)
    try:
        codes = []
        for rank in range(int(sys.argv[3])):
            env = {"RANK": str(rank), "ONLY_THIS": "1", "SPARKGPU_HF_RESUME": "0", "PATH": os.environ.get("PATH", "")}
            pid = spares.take(env, None, None)
            codes.append(ForkedRank(pid, ("rank",)).wait(timeout=30))
    finally:
        spares.close()
    print(json.dumps(codes))
    """
)


def _run(tmp_path, air: str, spares: int = 1, taken: int = 1) -> tuple[list[int], str]:
    """Runs ``air`` in ``taken`` of ``spares`` spares; returns their exit statuses and stderr."""
    done = subprocess.run(
        [sys.executable, "-c", _HARNESS, str(tmp_path), str(spares), str(taken)],
        input=textwrap.dedent(air),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def test_a_rank_runs_the_text_as_main_with_its_variables_argv_key_and_own_session(tmp_path):
    codes, _ = _run(
        tmp_path,
        """
        import json, os, sys
        fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
        seen = {
            "name": __name__,
            "main": sys.modules["__main__"].__dict__ is globals(),
            "argv": sys.argv,
            "key": globals().pop("_sparkgpu_job_key").decode(),
            "env": dict(os.environ),
            "session_leader": os.getsid(0) == os.getpid(),
            "fds": fds,
            "handlers": [str(signal) for signal in (2, 15)],
            "hf_resume": __import__("sparkgpu.config").config.settings().hf_resume,
        }
        import signal
        seen["handlers"] = [signal.getsignal(s) == signal.SIG_DFL for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)]
        with open(os.path.join(sys.argv[1], "rank-%s.json" % os.environ["RANK"]), "w") as f:
            json.dump(seen, f)
        """,
        spares=2,
        taken=2,
    )
    assert codes == [0, 0]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert seen["name"] == "__main__" and seen["main"]
        assert seen["argv"] == ["-c", str(tmp_path)]
        assert seen["key"] == "k" * 32
        assert seen["env"]["RANK"] == str(rank) and seen["env"]["ONLY_THIS"] == "1"
        assert set(seen["env"]) <= {
            "RANK",
            "ONLY_THIS",
            "SPARKGPU_HF_RESUME",
            "PATH",
        }  # exactly what torch's agent gave it
        assert seen["hf_resume"] is False  # settings read from the rank's variables, not the agent's cache
        assert seen["session_leader"]
        assert seen["fds"][:3] == [0, 1, 2] and len(seen["fds"]) == 4  # the three, and listdir's own
        assert all(seen["handlers"])


@pytest.mark.parametrize(
    "air, code, printed",
    [
        ("pass", 0, ""),
        ("import sys; sys.exit(3)", 3, ""),
        ("import sys; sys.exit()", 0, ""),
        ("import sys; sys.exit('sparkgpu: refusing to run')", 1, "sparkgpu: refusing to run"),
        ("raise ValueError('bad batch')", 1, "ValueError: bad batch"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL, ""),
    ],
)
def test_a_rank_leaves_with_the_status_and_message_python_c_gives(tmp_path, air, code, printed):
    codes, stderr = _run(tmp_path, air)
    assert codes == [code]
    assert printed in stderr
    if code == 1 and "Error" in printed:
        assert "Traceback" in stderr


def test_a_ranks_exit_functions_run_and_its_output_is_flushed(tmp_path):
    _, stderr = _run(
        tmp_path,
        """
        import atexit, sys
        sys.stderr = open(2, "w", buffering=1 << 16, closefd=False)  # buffered: lost without a flush
        atexit.register(lambda: sys.stderr.write("exit function ran"))
        sys.stderr.write("buffered line")
        """,
    )
    assert "buffered line" in stderr and "exit function ran" in stderr


def test_spares_that_no_rank_takes_end_at_close(tmp_path):
    codes, _ = _run(tmp_path, "open(__import__('sys').argv[1] + '/ran', 'w').close()", spares=3, taken=1)
    assert codes == [0]
    assert [p.name for p in tmp_path.iterdir()] == ["ran"]  # the two others ran nothing, and the harness reaped them


def test_a_forked_rank_handle_waits_polls_and_times_out_as_popen_does():
    import os

    from sparkgpu.launch.node.forked_ranks import ForkedRank

    pid = os.fork()
    if pid == 0:  # a child that only sleeps: nothing of the runner's threads is touched
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)"])
    rank = ForkedRank(pid, ("sleeper",))
    assert rank.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        rank.wait(timeout=0.1)
    rank.terminate()
    assert rank.wait(timeout=10) == -signal.SIGTERM
    assert rank.poll() == -signal.SIGTERM and rank.returncode == -signal.SIGTERM
    rank.kill()  # a reaped rank is not signalled again (its pid may be another process's by now)
