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
