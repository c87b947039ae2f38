"""The GPU weight path of the server backend: vLLM's own nccl weight transfer, driven over its HTTP endpoints.

Nothing here is ours but the glue: vLLM's trainer-side `NCCLTrainerWeightTransferEngine` does the rendezvous and
the (packed) broadcast; `HTTPWeightSyncClient` is the four-call control plane it expects
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``), and
`HFSource` hands it the trainer's weights under the Hugging Face names (`grpo.rollout.weights.hf_weights`: ZeRO-3
gathered one at a time, LoRA merged). The server must be started with ``--weight-transfer-config
'{"backend": "nccl"}'`` (grpo-serve does so on CUDA). NOT RUN on this project's machines (no GPU): written
against vLLM 0.32's interfaces, to be exercised by ``scripts/bench_gpu.sh``'s server case.
"""
from __future__ import annotations


class HTTPWeightSyncClient:
    """vLLM's `VLLMWeightSyncClient` protocol over one server's RL endpoints."""

    def __init__(self, server):
        self.server = server

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.server.post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.server.post("/start_weight_update")

    def update_weights(self, update_info) -> None:
        self.server.post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.server.post("/finish_weight_update", {"weight_version": weight_version})


def hf_source(model, full_weights):
    """A vLLM `WeightSource` over the trainer's weights; its metadata comes from one pass, made once."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    from grpo.rollout.weights import hf_weights

    class HFSource(WeightSource):
        def __init__(self):
            self._meta = None

        def metadata(self):
            if self._meta is None:
                self._meta = [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in hf_weights(model, full_weights)]
            return self._meta

        def __iter__(self):
            return hf_weights(model, full_weights)

    return HFSource()


class NCCLTransfer:
    """One server (tensor-parallel ``tp``) fed by vLLM's nccl engine; rank 0 of the trainer sends. ``send`` gets the
    model through `bind` (vLLM's engine iterates its source itself)."""

    def __init__(self, host: str, tp: int, rank: int = 0):
        self.host, self.tp, self.rank, self.engine, self.model, self.full_weights = host, tp, rank, None, None, None

    def bind(self, model, full_weights) -> None:
        self.model, self.full_weights = model, full_weights

    def connect(self, servers) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        from grpo.rollout.server.client import ServerError
        from grpo.runtime.transfer import free_port

        if len(servers) != 1:
            raise ServerError("rollout.server.weight_transfer=nccl feeds one server; give one URL in "
                              "rollout.server.urls (or use gloo)")
        info = NCCLTrainerInitInfo(master_address=self.host, master_port=free_port(self.host),
                                   world_size=1 + self.tp, rank=self.rank)
        self.engine = WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPWeightSyncClient(servers[0]), source=hf_source(self.model, self.full_weights))

    def send(self, weights, servers) -> None:
        weights.close()  # the engine iterates its own source
        self.engine.send_weights()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
