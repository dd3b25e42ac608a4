"""A replay's progress bar: hidden for the first seconds, then elapsed time, simulated time and an ETA."""

from __future__ import annotations

from sim.app.progress import Progress


def test_a_replay_bar_waits_before_showing(capsys, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("sim.app.progress.time.monotonic", lambda: clock[0])
    bar = Progress(1000, "requests finished", enabled=True, show_after_s=2.0)
    clock[0] += 1.0
    bar(12.5, 100)  # after 1 s: nothing yet
    assert capsys.readouterr().err == ""
    clock[0] += 2.0
    bar(40.0, 250)  # after 3 s: a quarter done, so 9 s to go
    err = capsys.readouterr().err
    assert "250/1000 requests finished" in err and "simulated 40.0 s" in err
    assert "0:03 elapsed" in err and "ETA 0:09" in err
    bar.close()
    assert capsys.readouterr().err == "\n"


def test_a_replay_bar_is_silent_off_a_terminal_or_quiet(capsys):
    for quiet in (False, True):  # pytest's stderr is not a terminal
        bar = Progress.for_replay(10, quiet=quiet)
        bar(1.0, 5)
        bar.close()
    assert not Progress.for_replay(10, quiet=False).enabled
    assert capsys.readouterr().err == ""
