import io

from sparkgpu.launch.client.logs import LogStreamer
from sparkgpu.rundir.directory import RunDir
from sparkgpu.rundir.layout import RunLayout


def test_streams_complete_lines_with_rank_prefix_and_keeps_partial_ones(tmp_path):
    rd = RunDir(tmp_path / "job")
    rd.prepare_attempt(0)
    out = io.StringIO()
    streamer = LogStreamer(rd, 0, world_size=2, ranks=None, out=out)
    rd.file(RunLayout.rank_log(0, 0)).write_text("epoch 1\nloss=0.")
    rd.file(RunLayout.rank_log(0, 1)).write_text("warming up\n")
    streamer.pump()
    assert out.getvalue() == "[rank0] epoch 1\n[rank1] warming up\n"
    with open(rd.file(RunLayout.rank_log(0, 0)), "a") as f:
        f.write("5\nno newline at the end")
    streamer.pump()
    assert out.getvalue().endswith("[rank0] loss=0.5\n")
    streamer.finish()
    assert out.getvalue().endswith("[rank0] no newline at the end\n")


def test_only_selected_ranks_stream(tmp_path):
    rd = RunDir(tmp_path / "job")
    rd.prepare_attempt(0)
    for r in range(3):
        rd.file(RunLayout.rank_log(0, r)).write_text(f"r{r}\n")
    out = io.StringIO()
    LogStreamer(rd, 0, world_size=3, ranks=(0, 2), out=out).finish()
    assert out.getvalue() == "[rank0] r0\n[rank2] r2\n"


def test_finish_writes_a_burst_far_larger_than_one_read_to_its_last_line(tmp_path):
    rd = RunDir(tmp_path / "job")
    rd.prepare_attempt(0)
    lines = [f"step {i:07d} " + "x" * 90 for i in range(120_000)]  # about 12 MB
    rd.file(RunLayout.rank_log(0, 0)).write_text("\n".join(lines) + "\nTraceback: the last words")
    rd.file(RunLayout.rank_log(0, 1)).write_text("rank 1 done\n")
    out = io.StringIO()
    streamer = LogStreamer(rd, 0, world_size=2, ranks=None, out=out)
    streamer.pump()  # a live pass before the end reads a bounded part only
    streamer.finish()
    written = out.getvalue().splitlines()
    assert written[-1] == "[rank0] Traceback: the last words"
    assert [w for w in written if w.startswith("[rank0] step")] == ["[rank0] " + line for line in lines]
    assert "[rank1] rank 1 done" in written
