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
