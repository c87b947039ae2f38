"""grpo/rollout/vllm_log.py: the lines every healthy in-process vLLM engine of ours prints are left out, the rest of
vLLM's log is kept (run without vLLM: the records are logged on the loggers vLLM's modules use)."""
import logging

from grpo.rollout.vllm_log import SOURCES, quiet_expected


def test_the_expected_lines_are_left_out_and_the_rest_kept():
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    quiet_expected()
    quiet_expected()  # one filter each, however many engines are made
    renderer, reload = (logging.getLogger(name) for name in SOURCES)
    assert all(len(logging.getLogger(name).filters) == 1 for name in SOURCES)
    handler = Keep()
    for log in (renderer, reload):
        log.addHandler(handler)
    try:
        try:
            raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
        except ValueError:
            renderer.warning("Chat template warmup failed", exc_info=True)
        renderer.warning("Using None for %s token id because tokenizer is not initialized", "EOS")
        reload.warning("%s: Failed to load weights", "RotaryEmbedding")
        reload.warning("%s: Failed to load weights", "LlamaAttention")  # a layer with weights: a real failure
        renderer.warning("something else")
    finally:
        for log in (renderer, reload):
            log.removeHandler(handler)
    assert seen == ["LlamaAttention: Failed to load weights", "something else"]


def test_the_filters_sit_on_the_loggers_of_vllms_renderer_and_layerwise_reload_and_keep_the_others_own():
    """The loggers vLLM 0.32's modules log these lines on, by name (`SOURCES` is what is filtered), each given one
    filter of ours next to a filter of its own."""
    from grpo.rollout.vllm_log import ExpectedLines

    class Own(logging.Filter):
        pass

    renderer = logging.getLogger("vllm.renderers.base")
    own = Own()
    renderer.addFilter(own)
    try:
        quiet_expected()
        quiet_expected()
        names = ("vllm.renderers.base", "vllm.model_executor.model_loader.reload.layerwise")
        assert [sum(isinstance(f, ExpectedLines) for f in logging.getLogger(n).filters) for n in names] == [1, 1]
        assert own in renderer.filters
    finally:
        renderer.removeFilter(own)
    record = logging.LogRecord("vllm.renderers.base", logging.WARNING, __file__, 1, "fine: %s", ("x",), None)
    assert ExpectedLines().filter(record) is True
    for text in ("Chat template warmup failed", "Using None for BOS token id because tokenizer is not initialized",
                 "RotaryEmbedding: Failed to load weights"):
        record = logging.LogRecord("vllm.renderers.base", logging.WARNING, __file__, 1, "%s", (text,), None)
        assert ExpectedLines().filter(record) is False
