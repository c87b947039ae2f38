"""grpo/trainer/signals.py: the first signal asks the loop to stop after its step, the second stops at once."""
import os
import signal

import pytest

from grpo.trainer.signals import StopNow, StopSignals


def test_first_signal_requests_a_stop_the_second_stops_now_and_handlers_are_restored(capsys):
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals(saved=lambda: "checkpoint X is intact") as s:
        s.step = 3
        os.kill(os.getpid(), signal.SIGTERM)
        assert s.requested
        with pytest.raises(StopNow):
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before
    err = capsys.readouterr().err
    assert "stopping after step 3" in err and "checkpoint X is intact" in err


def test_a_second_signal_after_the_stops_checkpoint_says_the_step_was_finished(capsys):
    with StopSignals(saved=lambda: "checkpoints/step_3 is intact") as s:
        s.step = 3
        os.kill(os.getpid(), signal.SIGINT)
        s.saved_step = 3  # the loop wrote step 3's checkpoint (the stop's)
        with pytest.raises(StopNow) as e:
            os.kill(os.getpid(), signal.SIGINT)
    assert e.value.exit_code == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "[grpo] second SIGINT: stopping now; step 3 was finished and its checkpoint written: " \
                   "checkpoints/step_3 is intact"


def test_a_second_signal_in_the_step_after_a_periodic_checkpoint_says_that_step_is_lost(capsys):
    with StopSignals(saved=lambda: "checkpoints/step_2 is intact") as s:
        s.step, s.saved_step = 3, 2
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(StopNow):
            os.kill(os.getpid(), signal.SIGINT)
    assert "stopping now, without finishing step 3; checkpoints/step_2 is intact" in capsys.readouterr().err
