"""The piece of the server backend that runs inside vLLM's server: a worker extension (``--worker-extension-cls``).

vLLM mixes this class into its worker; the trainer calls its methods through vLLM's own ``POST /collective_rpc``
(string arguments, JSON results). It exists because vLLM's weight-transfer engines need CUDA: on CPU the weights
come through a gloo group of our own (`grpo.runtime.transfer.WeightChannel`) and go into the model through the
same in-place ``reload_weights`` the in-process backend uses (q/k/v and gate/up fused by vLLM). On GPUs the
nccl path is vLLM's own (``/init_weight_transfer_engine``, ``/update_weights``) and this class only answers
`grpo_model_info`.
"""
from __future__ import annotations

import json
import os


class GRPOWorkerExtension:
    """Methods the trainer calls on every worker of a server (``collective_rpc``)."""

    def grpo_model_info(self) -> dict:
        """What the server serves, for the trainer's check at connect: the model's shape and its max length."""
        from grpo.rollout.server.facts import model_facts

        cfg = self.model_runner.model_config
        lora = getattr(self.model_runner, "lora_config", None)  # --enable-lora's settings, None without
        return {**model_facts(cfg.hf_config),
                "max_model_len": cfg.max_model_len, "dtype": str(cfg.dtype).replace("torch.", ""),
                "pushes": getattr(self, "_grpo_pushes", 0),
                "max_lora_rank": lora.max_lora_rank if lora else 0, "max_loras": lora.max_loras if lora else 0,
                "lora_dir": self._grpo_lora_dir() if lora else None}

    def _grpo_lora_dir(self) -> str:
        """Where this server writes the adapters it receives (a RAM-backed /dev/shm where there is one), removed
        when the server exits (a killed server leaves it: grpo-serve-lora-* in /dev/shm or the temp folder)."""
        import atexit
        import shutil
        import tempfile
        from pathlib import Path

        if getattr(self, "_grpo_lora", None) is None:
            self._grpo_lora = tempfile.mkdtemp(prefix="grpo-serve-lora-",
                                               dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
            atexit.register(shutil.rmtree, self._grpo_lora, True)
        return self._grpo_lora

    def grpo_receive_adapter(self, spec: str) -> dict:
        """Receive one adapter's tensors from the trainer and write them as the PEFT folder ``lora_dir/vN`` that
        ``/v1/load_lora_adapter`` then loads; ``spec`` is JSON {version, config, keep}: the folders of versions
        older than the newest ``keep`` are removed (`grpo.rollout.server.adapters`)."""
        import shutil
        from pathlib import Path

        from grpo.rollout.lora_sync import Adapter, write_peft_dir

        s = json.loads(spec)
        if getattr(self, "_grpo_channel", None) is None:
            raise RuntimeError("no trainer has joined this server's weight channel (grpo_join)")
        received = dict(self._grpo_channel.receive())
        root = Path(self._grpo_lora_dir())
        write_peft_dir(Adapter(received, s["config"]), root / f"v{int(s['version'])}")
        for old in root.glob("v*"):
            if old.name[1:].isdigit() and int(old.name[1:]) <= int(s["version"]) - int(s["keep"]):
                shutil.rmtree(old, ignore_errors=True)
        self._grpo_pushes = getattr(self, "_grpo_pushes", 0) + 1
        return {"received": len(received), "missing": []}

    def grpo_join(self, spec: str) -> dict:
        """Join the trainer's weight channel (two ends: the trainer, this worker): ``spec`` is JSON {host, port, rank,
        world_size, timeout_s}; both ends prove they hold the API key before any weight. A channel of an earlier
        trainer (one that died, or ended) is dropped first: a new trainer takes the server over."""
        from grpo.runtime.transfer import WeightChannel

        s = json.loads(spec)
        old = getattr(self, "_grpo_channel", None)
        if old is not None:
            old.close()
        self._grpo_channel = None
        channel = WeightChannel(s["host"], int(s["port"]), int(s["rank"]), int(s["world_size"]), float(s["timeout_s"]))
        # the server's key (grpo-serve hands it to vLLM as VLLM_API_KEY): a trainer that cannot prove it holds the
        # same pushes nothing
        if not channel.handshake(os.environ.get("VLLM_API_KEY") or ""):
            channel.close()
            raise PermissionError("the trainer on the weight channel did not present this server's API key")
        self._grpo_channel = channel
        return {"joined": True}

    def grpo_receive(self, left_out: str = "") -> dict:
        """Receive one stream of weights from the trainer and load it in place; says how many tensors came and
        which vLLM parameters (if any) they left unfilled, but those whose names hold ``left_out`` (a frozen vision
        tower's ``visual.``, which a push after the first leaves out: vLLM keeps what they hold)."""
        import re

        from grpo.rollout.vllm import CaptureNotLoaded

        channel = getattr(self, "_grpo_channel", None)
        if channel is None:
            raise RuntimeError("no trainer has joined this server's weight channel (grpo_join)")
        # the whole stream first, then the reload: vLLM's in-place reload cut off half way (a trainer killed during
        # its push) would leave the model half swapped and unloadable; so a lost push changes nothing
        received = list(channel.receive())
        with CaptureNotLoaded() as missing:
            self.model_runner.reload_weights(weights_iterator=iter(received), is_checkpoint_format=True)
        count = len(received)
        del received
        self._grpo_pushes = getattr(self, "_grpo_pushes", 0) + 1  # weight streams loaded since the server started
        unfilled = [m for m in missing.messages if not left_out or
                    any(left_out not in n for n in re.findall(r"'([^']+)'", m) or [m])]
        return {"received": count, "missing": unfilled[:1]}
