"""grpo/trainer/run.py: LoopState's starting values (what a fresh run and a checkpoint's restore start from) and what
`Run.close` gives back."""
from grpo.trainer.run import LoopState, Run


def test_a_fresh_state_starts_at_step_zero_with_no_buffer():
    s = LoopState()
    assert (s.step, s.buffer, s.bad_steps, s.skipped_steps, s.stop_requested) == (0, None, 0, 0, False)
    assert s.failed_reward_steps == {} and LoopState().failed_reward_steps is not s.failed_reward_steps
    assert {"settings", "sampler", "eval_backend", "toolset"} <= set(Run.__dataclass_fields__)


def test_close_gives_back_the_sampler():
    closed = []

    class Held:
        def close(self):
            closed.append("sampler")

    Run(**{**dict.fromkeys(Run.__dataclass_fields__), "sampler": Held()}).close()
    assert closed == ["sampler"]


def _run(**kw):
    return Run(**{**dict.fromkeys(Run.__dataclass_fields__), **kw})


def test_the_model_optimizer_and_scheduler_are_the_runtimes_and_a_fresh_state_has_nothing_in_flight():
    from types import SimpleNamespace

    rt = SimpleNamespace(model="wrapped", optimizer="adamw", scheduler="cosine")
    run = _run(runtime=rt, policy="as loaded")
    assert (run.model, run.optimizer, run.scheduler) == ("wrapped", "adamw", "cosine")
    assert LoopState().in_flight is None
    fields = Run.__dataclass_fields__
    assert [fields[k].default for k in ("owns_output_dir", "toolset", "image_processor")] == [True, None, None]


def test_the_reference_is_the_frozen_copy_else_the_policy_with_its_adapter_disabled():
    import contextlib
    from types import SimpleNamespace

    class Lora:
        def disable_adapter(self):
            return "adapter disabled"

    lora = Lora()
    run = _run(runtime=SimpleNamespace(model=lora), reference=None)
    assert run.reference_context() == "adapter disabled" and run.reference_model() is lora
    run = _run(runtime=SimpleNamespace(model=lora), reference="frozen copy")  # a copy: the adapter stays on
    assert isinstance(run.reference_context(), contextlib.nullcontext) and run.reference_model() == "frozen copy"
    run = _run(runtime=SimpleNamespace(model="full"), reference=None)  # beta = 0: no reference, nothing to disable
    assert isinstance(run.reference_context(), contextlib.nullcontext) and run.reference_model() == "full"
