"""grpo/errors.py: every error meant for the user is a GRPOError (the CLI prints its one line)."""
import pytest

from grpo import errors


@pytest.mark.parametrize("name", ["ConfigError", "SetupError", "DataError", "ModelError", "RewardSpecError",
                                  "RewardCountError", "RewardTimeout", "PeerLostError"])
def test_every_user_error_is_a_grpo_error_and_keeps_its_builtin_kind(name):
    cls = getattr(errors, name)
    assert issubclass(cls, errors.GRPOError)
    assert issubclass(errors.ConfigError, ValueError) and issubclass(errors.RewardTimeout, TimeoutError)


def test_our_warnings_show_as_one_line_and_others_as_python_shows_them(capsys):
    """The top-p warning came out as `.../torch/utils/_contextlib.py:120: UserWarning: ...` (the frame of torch's
    no_grad wrapper): ours are one `[grpo] warning:` line under the commands."""
    import warnings

    from grpo.errors import GRPOWarning, show_warnings_as_lines
    from grpo.models import char_tokenizer, tiny_model
    from grpo.rollout import hf as rollout
    from grpo.rollout.base import Sampling

    before = warnings.formatwarning
    try:
        show_warnings_as_lines()
        show_warnings_as_lines()  # idempotent: grpo-train's and grpo-serve's main both call it
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rollout._warned_truncated = False
            rollout.generate(tiny_model("llama", 100), char_tokenizer(), [[5, 6]], Sampling(2, top_p=0.9),
                             group_size=2, progress=False)
            warnings.warn("someone else's", UserWarning)
        shown = [warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught]
    finally:
        warnings.formatwarning = before
    assert shown[0].startswith("[grpo] warning: rollout.top_p=0.9 / rollout.top_k=0: completions are sampled from")
    assert shown[0].count("\n") == 1 and "UserWarning: someone else's" in shown[1]
    assert not issubclass(UserWarning, GRPOWarning)


def test_showing_warnings_as_lines_twice_wraps_once_and_others_keep_pythons_exact_text():
    """A second call (grpo-train's and grpo-serve's main both make one) keeps the one formatter in place rather
    than wrapping it again; a warning of another library reads exactly as Python's own formatter writes it, with
    its file, line number and source line."""
    import warnings

    from grpo.errors import GRPOWarning, show_warnings_as_lines

    before = warnings.formatwarning  # an earlier test in this process may have put the formatter in place already
    warnings.formatwarning = warnings._formatwarning_orig  # Python's own, as a fresh process starts with
    try:
        show_warnings_as_lines()
        first = warnings.formatwarning
        show_warnings_as_lines()
        assert warnings.formatwarning is first and first is not warnings._formatwarning_orig
        theirs = warnings.formatwarning("deprecated", DeprecationWarning, "lib/mod.py", 7, "x = old()")
        ours = warnings.formatwarning("check the key", GRPOWarning, "lib/mod.py", 7, "x = old()")
    finally:
        warnings.formatwarning = before
    assert theirs == warnings._formatwarning_orig("deprecated", DeprecationWarning, "lib/mod.py", 7, "x = old()")
    assert theirs == "lib/mod.py:7: DeprecationWarning: deprecated\n  x = old()\n"
    assert ours == "[grpo] warning: check the key\n"
