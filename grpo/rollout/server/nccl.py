"""The GPU weight path of the server backend: vLLM's own nccl weight transfer, driven over its HTTP endpoints.

Nothing here is ours but the glue: vLLM's trainer-side `NCCLTrainerWeightTransferEngine` does the rendezvous and
the (packed) broadcast; `HTTPWeightSyncClient` is the four-call control plane it expects
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, each with
the API key: grpo-serve's guard wants it there), and `StreamSource` is the `WeightSource` it reads.

**What the engine reads: the stream it is handed, never the live model.** vLLM's engine iterates its source
itself, during ``send_weights``. Our source is fed, before each send, the very stream the gloo path gets: in the
synchronous loop the trainer's weights between two steps (`grpo.rollout.weights.hf_weights`: ZeRO-3 gathered one at a
time, LoRA merged; nothing trains during the push), in the asynchronous one the host snapshot `ServerGenerator.publish`
took of version v (the optimizer goes on with v+1 while it is sent, and cannot change what is sent). Each tensor is
copied to this rank's GPU as the engine reaches it, so a snapshot costs host memory only, one tensor at a time on the
GPU. The parameter list vLLM sizes its receive buffers from (``metadata()``) is the first stream's names, dtypes and
shapes (the first push holds that stream's tensors at once: the whole model, once); it never changes in a run and
vLLM checks every later stream against it.

One engine (one nccl group, ``1 + tensor_parallel_size`` ranks) per server: a server that dies fails only its own
send, and the backend drops it (`grpo.rollout.server.backend.ServerBackend.push`). With several servers each stream
is held whole for the time of the push (a snapshot's tensors, or the synchronous stream's). The server must be started
with ``--weight-transfer-config '{"backend": "nccl"}'`` (grpo-serve does so on CUDA). Not run on this project's CPU
machines: written against vLLM 0.32's interfaces, unit-tested with a fake engine (tests/rollout/server/test_nccl.py),
exercised by ``scripts/bench_gpu.sh``'s server case.
"""
from __future__ import annotations

from grpo.rollout.server.client import RESUME, ServerError


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


class StreamSource:
    """A re-fed `WeightSource`: ``feed(pairs)`` before each send; iteration yields those pairs, each on ``device``.
    (vLLM's abstract base is mixed in by `vllm_source`, so this class needs no vLLM.)"""

    def __init__(self, device, meta_of=None):
        self.device, self.meta_of, self.meta, self.pairs = device, meta_of, None, ()

    def feed(self, pairs) -> None:
        if self.meta is None:  # the first stream: held whole once, to declare what every stream holds
            pairs = list(pairs)
            self.meta = [self.meta_of(n, t) if self.meta_of else (n, t.dtype, tuple(t.shape)) for n, t in pairs]
        self.pairs = pairs

    def metadata(self):
        return self.meta

    def __iter__(self):
        pairs, self.pairs = self.pairs, ()  # one pass per feed: a stream is read once
        for name, t in pairs:
            yield name, t.detach().to(self.device)


def vllm_source(device) -> StreamSource:
    """A `StreamSource` that is vLLM's `WeightSource` (its metadata vLLM's `ParamMeta`)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class Source(StreamSource, WeightSource):
        pass

    return Source(device, meta_of=lambda n, t: ParamMeta(n, t.dtype, tuple(t.shape)))


def vllm_engine(host: str, port: int, world_size: int, client, source):
    """vLLM's trainer-side nccl engine, rendezvoused with one server (this process rank 0, its workers 1..tp)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    info = NCCLTrainerInitInfo(master_address=host, master_port=port, world_size=world_size, rank=0)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


class NCCLTransfer:
    """Rank 0's nccl engines, one per server of ``tp`` GPUs. ``engine`` and ``source`` (vLLM's by default) are
    where a test puts fakes."""

    def __init__(self, host: str, tp: int, device="cuda", engine=vllm_engine, source=vllm_source):
        self.host, self.tp, self.device = host, tp, device
        self.make_engine, self.make_source = engine, source
        self.engines: dict = {}  # url -> (engine, source)

    def connect(self, servers) -> None:
        from grpo.runtime.transfer import free_port

        for s in servers:
            if s.url in self.engines:  # a server that restarted and rejoins: its old group is dead
                self._shut(s.url)
            source = self.make_source(self.device)
            port = free_port(self.host)
            try:
                engine = self.make_engine(self.host, port, 1 + self.tp, HTTPWeightSyncClient(s), source)
            except Exception as e:  # noqa: BLE001 - vLLM's rendezvous errors are many; one line names the server
                if isinstance(e, ServerError):
                    raise
                raise ServerError(f"rollout server {s.url} could not join the trainer's nccl weight transfer at "
                                  f"{self.host}:{port} ({_line(e)}); start it with grpo-serve on CUDA and set "
                                  "rollout.server.trainer_host to an address it reaches") from None
            self.engines[s.url] = (engine, source)

    def send(self, weights, servers) -> dict[str, str]:
        """Send ``weights`` to every server through its engine; returns {url: why} of those whose send failed."""
        live = [s for s in servers if s.url in self.engines]
        if len(live) > 1:
            weights = list(weights)  # each engine reads the stream once
        failed: dict[str, str] = {}
        for s in live:
            engine, source = self.engines[s.url]
            source.feed(weights)
            try:
                engine.send_weights()
            except Exception as e:  # noqa: BLE001 - the group is unusable after any failure: that server is lost
                failed[s.url] = str(e) if isinstance(e, ServerError) else (
                    f"rollout server {s.url} lost its nccl weight transfer during a push ({_line(e)}); {RESUME}")
                self._shut(s.url)
        return failed

    def _shut(self, url: str) -> None:
        engine, _ = self.engines.pop(url)
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - a broken group may fail to close; it is dropped either way
            pass

    def close(self) -> None:
        for url in list(self.engines):
            self._shut(url)


def _line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}" if str(e) else type(e).__name__
