"""`imported` never hands out a module that another thread is still importing."""

import importlib
import sys
import threading
import types

from sparkgpu._util.modules import imported


def test_a_module_nobody_imported_is_none_and_stays_unimported():
    assert imported("sparkgpu_never_imported_module") is None
    assert "sparkgpu_never_imported_module" not in sys.modules


def test_an_import_in_progress_on_another_thread_is_waited_for(tmp_path, monkeypatch):
    # The ranks import MLflow on a background thread while the training function may already
    # save a checkpoint that asks for the active run: that call must see the whole module.
    signal = types.ModuleType("slow_import_signal")
    signal.started, signal.release = threading.Event(), threading.Event()
    monkeypatch.setitem(sys.modules, "slow_import_signal", signal)
    (tmp_path / "slow_to_import.py").write_text(
        "import slow_import_signal\n"
        "slow_import_signal.started.set()\n"
        "slow_import_signal.release.wait(30)\n"
        "def active_run():\n"
        "    return 'complete'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slow_to_import", raising=False)

    thread = threading.Thread(target=importlib.import_module, args=("slow_to_import",))
    thread.start()
    try:
        assert signal.started.wait(10)
        half = sys.modules["slow_to_import"]
        assert not hasattr(half, "active_run")  # what sys.modules.get would hand out
        threading.Timer(0.3, signal.release.set).start()
        got = imported("slow_to_import")
        assert got.active_run() == "complete"
    finally:
        signal.release.set()
        thread.join()
        monkeypatch.delitem(sys.modules, "slow_to_import", raising=False)
