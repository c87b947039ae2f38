"""grpo/errors.py: every error meant for the user is a GRPOError (the CLI prints its one line)."""
import pytest

from grpo import errors


@pytest.mark.parametrize("name", ["ConfigError", "SetupError", "DataError", "ModelError", "RewardSpecError",
                                  "RewardCountError", "RewardTimeout", "PeerLostError"])
def test_every_user_error_is_a_grpo_error_and_keeps_its_builtin_kind(name):
    cls = getattr(errors, name)
    assert issubclass(cls, errors.GRPOError)
    assert issubclass(errors.ConfigError, ValueError) and issubclass(errors.RewardTimeout, TimeoutError)
