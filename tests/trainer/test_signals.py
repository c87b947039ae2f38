"""grpo/trainer/signals.py: the first signal asks the loop to stop after its step, the second stops at once.

Every signal is sent only after checking that `StopSignals` handles it (`send`): a broken handler (a mutant under
`make mutate`) fails that check instead of letting SIGTERM end the test process or SIGINT interrupt the session."""
import io
import os
import signal
import sys
import threading

import pytest

from grpo.trainer.signals import StopNow, StopSignals


def send(s: StopSignals, sig) -> None:
    assert signal.getsignal(sig) == s._handle, f"{sig!r} is not handled by StopSignals"
    os.kill(os.getpid(), sig)


def test_first_signal_requests_a_stop_the_second_stops_now_and_handlers_are_restored(capsys):
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals(saved=lambda: "checkpoint X is intact") as s:
        s.step = 3
        assert not s.requested
        send(s, signal.SIGTERM)
        assert s.requested
        with pytest.raises(StopNow):
            send(s, signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before
    err = capsys.readouterr().err
    assert "stopping after step 3" in err and "checkpoint X is intact" in err


def test_the_lines_each_signal_prints(capsys):
    with StopSignals(saved=lambda: "checkpoints/step_2 is intact") as s:
        s.step = 4
        send(s, signal.SIGTERM)
        with pytest.raises(StopNow) as e:
            send(s, signal.SIGTERM)
    assert capsys.readouterr().err.splitlines() == [
        "[grpo] SIGTERM: stopping after step 4, then writing a checkpoint (send it again to stop at once, without "
        "saving that step)",
        "[grpo] second SIGTERM: stopping now, without finishing step 4; checkpoints/step_2 is intact"]
    assert e.value.exit_code == 143 and str(e.value) == "SIGTERM"  # 128 + 15, as a shell reports a SIGTERM'd process


def test_both_signals_are_handled_and_every_handler_is_restored():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with StopSignals(announce=False) as s:
        assert {sig: signal.getsignal(sig) for sig in before} == {sig: s._handle for sig in before}
    assert {sig: signal.getsignal(sig) for sig in before} == before
    with StopSignals(announce=False) as again:  # entered again after leaving: handled again, restored again
        assert signal.getsignal(signal.SIGINT) == again._handle
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_nothing_is_requested_before_a_signal_and_leaving_twice_restores_once():
    s = StopSignals(announce=False)
    assert (s.requested, s.step, s.saved_step) == (False, None, None) and s.requested is False
    with s:
        pass
    mine = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # installed after the first exit: a second one leaves it
    try:
        s.__exit__(None, None, None)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, mine)


def test_without_saved_the_lines_say_what_a_stop_leaves(capsys):
    with StopSignals() as s:
        s.step = 2
        send(s, signal.SIGINT)
        with pytest.raises(StopNow):
            send(s, signal.SIGINT)
    assert capsys.readouterr().err.splitlines()[-1] == \
        "[grpo] second SIGINT: stopping now, without finishing step 2; nothing more is saved"
    with StopSignals() as s:
        s.step = s.saved_step = 2
        send(s, signal.SIGINT)
        with pytest.raises(StopNow):
            send(s, signal.SIGINT)
    assert capsys.readouterr().err.splitlines()[-1] == \
        "[grpo] second SIGINT: stopping now; step 2 was finished and its checkpoint written: it is complete"


def test_a_rank_that_does_not_announce_prints_nothing(capsys):
    with StopSignals(announce=False, saved=lambda: "x") as s:
        send(s, signal.SIGTERM)
        with pytest.raises(StopNow):
            send(s, signal.SIGTERM)
    assert s.requested and capsys.readouterr().err == ""


def test_a_signal_inside_a_write_to_stderr_is_written_past_it(capfd, monkeypatch):
    class Reentrant(io.StringIO):
        def write(self, text):
            raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

    monkeypatch.setattr(sys, "stderr", Reentrant())
    StopSignals()._say("stopping")
    assert capfd.readouterr().err == "[grpo] stopping\n"  # os.write(2, ...) straight to the descriptor


def test_outside_the_main_thread_no_handler_is_installed():
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def enter():
        with StopSignals(announce=False) as s:
            seen.append((s._previous, signal.getsignal(signal.SIGTERM)))

    t = threading.Thread(target=enter)
    t.start()
    t.join()
    assert seen == [({}, before)]


def test_a_second_signal_after_the_stops_checkpoint_says_the_step_was_finished(capsys):
    with StopSignals(saved=lambda: "checkpoints/step_3 is intact") as s:
        s.step = 3
        send(s, signal.SIGINT)
        s.saved_step = 3  # the loop wrote step 3's checkpoint (the stop's)
        with pytest.raises(StopNow) as e:
            send(s, signal.SIGINT)
    assert e.value.exit_code == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "[grpo] second SIGINT: stopping now; step 3 was finished and its checkpoint written: " \
                   "checkpoints/step_3 is intact"


def test_a_second_signal_in_the_step_after_a_periodic_checkpoint_says_that_step_is_lost(capsys):
    with StopSignals(saved=lambda: "checkpoints/step_2 is intact") as s:
        s.step, s.saved_step = 3, 2
        send(s, signal.SIGINT)
        with pytest.raises(StopNow):
            send(s, signal.SIGINT)
    assert "stopping now, without finishing step 3; checkpoints/step_2 is intact" in capsys.readouterr().err
