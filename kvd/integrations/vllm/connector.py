"""`KvdConnector`: vLLM's KVConnectorBase_V1 over a kvd daemon (supported: vLLM 0.32).

vLLM builds two of these per engine: one beside the scheduler (role SCHEDULER), one in each
worker (role WORKER); each holds its own kvd session (`link.DaemonLink`).

Scheduler side (`plan.Planner`), for requests whose K/V follow from their token ids alone (not
multimodal, prompt-embedding, LoRA or cache_salt requests, which kvd neither loads nor saves):
`get_num_new_matched_tokens` hashes the request's full blocks
(chained kvd hashes under the model's salt, `salt.checkpoint_salt`) and looks up the longest
prefix kvd holds, pinning it; `update_state_after_alloc` plans the load of what vLLM accepted;
`build_connector_meta` hands the worker, per step, the loads (vLLM block ids + kvd hashes) and
the saves (every full block whose tokens are all known and computed by the end of the step and
that kvd lacks); `request_finished` releases the request's pins.

Worker side, per step (vLLM calls start_load_kv before the forward of a step that loads, after
the forward otherwise):
    start_load_kv        per load: look the hashes up again in the worker's own session (pins
                         the blocks for the copy); then per layer, one copy of every block
                         found into vLLM's paged KV; blocks not found (evicted, daemon stopped
                         or restarted clean) are load errors: vLLM recomputes from the first
    wait_for_layer_load  nothing: every layer was loaded (issued, on CUDA) in start_load_kv
    save_kv_layer        at the step's first layer, allocate kvd blocks for its saves; copy the
                         layer's K/V of the saved blocks into them (layer by layer, right after
                         the layer's attention wrote them)
    wait_for_save        synchronise (CUDA); seal the saved blocks if every layer was copied
                         and no load of this step failed (a failed load leaves garbage K/V in
                         its blocks, which attention in this step may have read), release them;
                         release the load pins
    get_block_ids_with_load_errors   this step's failed loads, then forgotten

kvd is a cache: a daemon that is absent at start-up or goes away later costs hits, never
requests (`link`); a daemon whose pool does not fit the model stops the engine at start-up.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvd.errors import BadArgsError, KvdError
from kvd.geometry import Geometry
from kvd.integrations.vllm.layout import HostPool, PagedLayer, backend_layout
from kvd.integrations.vllm.link import DaemonLink, check_fits
from kvd.integrations.vllm.plan import Planner, SaveSpec, StepPlan
from kvd.integrations.vllm.salt import checkpoint_salt, named_salt

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)


class KvdMetadata(KVConnectorMetadata):
    """One step's loads and saves, from the scheduler side to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KvdConnector(KVConnectorBase_V1):
    """kv_transfer_config: kv_connector "KvdConnector", kv_connector_module_path
    "kvd.integrations.vllm", kv_role "kv_both", kv_load_failure_policy "recompute";
    kv_connector_extra_config: kvd_name (daemon name or socket path; default $KVD_NAME or
    "default"), salt (optional: names the hashing namespace instead of the checkpoint), pool
    (where kvd serves several pools)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.geometry_wanted = _engine_shape(vllm_config, kv_cache_config)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning("kvd: kv_load_failure_policy is %r: a block kvd loses between lookup "
                           "and load fails its request; 'recompute' recomputes it instead",
                           self._kv_transfer_config.kv_load_failure_policy)
        self.link = DaemonLink(extra.get("kvd_name"), extra.get("pool"),
                               functools.partial(check_fits, self.geometry_wanted),
                               logger.warning)
        self.link.start()
        if role == KVConnectorRole.SCHEDULER:
            salt = (named_salt(str(extra["salt"])) if extra.get("salt") is not None
                    else checkpoint_salt(_model_dir(vllm_config),
                                         self.geometry_wanted["dtype"]))
            self.planner = Planner(self.geometry_wanted["block_size"], salt, self.link)
        else:
            self._worker = _WorkerSide(self.link, self.geometry_wanted)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer runs between layers: no whole-model CUDA graph

    # ---- scheduler side --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if not _token_ids_say_it_all(request):
            return 0, False  # never planned: neither loaded nor saved
        return self.planner.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.planner.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KvdMetadata(self.planner.step(scheduler_output))

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.planner.finished(request)
        return False, None

    # ---- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = self._vllm_config.compilation_config.static_forward_context
        self._worker.register(kv_caches, {name: layers[name].get_attn_backend().get_name()
                                          for name in kv_caches})

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.begin(self._plan())

    def _plan(self) -> StepPlan:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvdMetadata)
        return metadata.plan

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded (or issued the copies of) every layer

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._worker.save_layer(self._plan(), layer_name)

    def wait_for_save(self) -> None:
        self._worker.end(self._plan())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self._worker.close()
        self.link.close()


class _WorkerSide:
    """The worker's loads and saves of one step at a time (see the module docstring)."""

    def __init__(self, link: DaemonLink, shape: dict[str, Any]) -> None:
        self.link, self.shape = link, shape
        self.layers: dict[str, tuple[int, PagedLayer]] = {}
        self._host: HostPool | None = None
        self._host_client: object = None
        self._device = torch.device("cpu")
        self._load_pins: list[tuple[list[int], object]] = []
        self._load_errors: set[int] = set()
        self._step_failed_loads = False
        self._save_started = False
        self._saving: tuple[list[int], object] | None = None  # kvd blocks of this step's saves
        self._sources = torch.empty(0, dtype=torch.long)  # their vLLM blocks
        self._layers_saved: set[str] = set()
        self._keep_until_synchronized: list[torch.Tensor] = []  # sources of CUDA copies

    def register(self, kv_caches: dict[str, torch.Tensor], backends: dict[str, str]) -> None:
        geometry = Geometry(num_blocks=1, **self.shape)
        if len(kv_caches) != geometry.num_layers:
            raise BadArgsError(f"vLLM has {len(kv_caches)} attention layers with a KV cache, "
                               f"the kvd pool {geometry.num_layers}: start the daemon with "
                               f"--layers {len(kv_caches)}")
        ordered = sorted(kv_caches, key=extract_layer_index)
        for index, name in enumerate(ordered):
            cache = kv_caches[name]
            layout = backend_layout(backends[name], cache.device.type)
            self.layers[name] = (index, PagedLayer(cache, layout, geometry))
            self._device = cache.device

    # -- per step --
    def begin(self, plan: StepPlan) -> None:
        """The step's loads (vLLM calls this before the forward when the step has any): a
        lookup per request, then one copy per layer for all the blocks found."""
        found = [(spec, *self.link.lookup(spec.hashes)) for spec in plan.loads]
        host = self._host_pool() if any(block_ids for _, block_ids, _ in found) else None
        session = self.link.session()  # the session (and segment) `host` maps
        sources: list[int] = []  # kvd's blocks
        targets: list[int] = []  # vLLM's
        for spec, block_ids, looked_up_in in found:
            if block_ids and host is not None and looked_up_in == session:
                self._load_pins.append((block_ids, looked_up_in))
                sources += block_ids
                targets += spec.block_ids[:len(block_ids)]
            else:  # nothing found, or found in a session that died since
                block_ids = []
            if len(block_ids) < len(spec.block_ids):
                self._load_errors.update(spec.block_ids[len(block_ids):])
                self._step_failed_loads = True
        if host is not None and sources:
            target_ids = torch.tensor(targets, device=self._device)
            for index, layer in self.layers.values():
                layer.scatter(target_ids, host.read(sources, index))

    def save_layer(self, plan: StepPlan, layer_name: str) -> None:
        """Copy one layer of the step's saved blocks (allocated at the step's first layer)."""
        if not self._save_started:
            self._save_started = True
            if plan.saves:
                self._saving = self._alloc(sum(len(s.block_ids) for s in plan.saves))
                self._sources = torch.tensor([b for s in plan.saves for b in s.block_ids],
                                             device=self._device)
        host = self._host
        if self._saving is None or host is None or layer_name not in self.layers:
            return
        index, layer = self.layers[layer_name]
        blocks = layer.gather(self._sources)
        host.write(self._saving[0], index, blocks)
        self._keep_until_synchronized.append(blocks)
        self._layers_saved.add(layer_name)

    def _alloc(self, num_blocks: int) -> tuple[list[int], object] | None:
        done = self.link.call("allocating blocks to save", lambda client: client.alloc(num_blocks))
        if done is not None and self._host_pool() is None:  # (after the alloc: its segment)
            self.link.release(*done)
            return None
        return done

    def end(self, plan: StepPlan) -> None:
        """The step is over: seal and release its saves, release its loads' pins."""
        if self._host is not None:
            self._host.synchronize()
        self._keep_until_synchronized = []
        saving, self._saving = self._saving, None
        complete = len(self._layers_saved) == len(self.layers)
        self._layers_saved = set()
        if saving is not None:
            if complete and not self._step_failed_loads:
                self._seal(saving, plan.saves)
            self.link.release(*saving)  # sealed ones stay cached, the others are freed
        for block_ids, session in self._load_pins:
            self.link.release(block_ids, session)
        self._load_pins = []
        self._save_started = self._step_failed_loads = False

    def _seal(self, saving: tuple[list[int], object], saves: list[SaveSpec]) -> None:
        block_ids, session = saving
        if session != self.link.session():
            return  # the daemon restarted since the alloc: those blocks are gone
        try:
            session[0].seal(block_ids, [h for s in saves for h in s.hashes],  # type: ignore[index]
                            parents=[p for s in saves for p in s.parents])
        except KvdError as exc:
            self.link.failed("sealing saved blocks", exc)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _host_pool(self) -> HostPool | None:
        """kvd's pool for this step's copies: None without a daemon; renewed with the session."""
        client = self.link.client()
        if client is None:
            self._drop_host()
            return None
        if (self._host is None or self._host_client is not client
                or self._host.segment_uuid != client.info["segment_uuid"]):
            self._drop_host()
            self._host, self._host_client = HostPool(client, self._device), client
        return self._host

    def _drop_host(self) -> None:
        host, self._host, self._host_client = self._host, None, None
        if host is not None:
            host.close()

    def close(self) -> None:
        self._drop_host()


def _token_ids_say_it_all(request: Request) -> bool:
    """Whether the request's K/V follow from its token ids and the model alone: not so with
    images or other multimodal inputs (placeholder tokens), prompt embeddings, a LoRA adapter,
    or a cache_salt (vLLM's per-tenant isolation of the prefix cache)."""
    return not (request.mm_features or request.prompt_embeds is not None
                or request.lora_request is not None or request.cache_salt is not None)


def _engine_shape(config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> dict[str, Any]:
    """The kvd geometry this engine needs (less num_blocks); BadArgsError for what kvd cannot
    serve: parallel engines, quantised KV caches, layers other than full attention."""
    model, parallel, cache = config.model_config, config.parallel_config, config.cache_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
        raise BadArgsError("kvd's vLLM connector serves single-worker engines: run with "
                           "tensor_parallel_size=1 and pipeline_parallel_size=1")
    if cache.cache_dtype != "auto":
        raise BadArgsError(f"kvd keeps K/V in the model's dtype; kv_cache_dtype "
                           f"{cache.cache_dtype!r} is not supported: leave it 'auto'")
    if kv_cache_config is not None:
        specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
        if len(specs) != 1 or type(specs[0]) is not FullAttentionSpec:
            raise BadArgsError("kvd's vLLM connector supports models whose layers are all full "
                               f"attention; this one has KV cache groups {specs}")
    return {"num_layers": model.get_num_layers(parallel),
            "num_kv_heads": model.get_num_kv_heads(parallel),
            "head_dim": model.get_head_size(), "block_size": cache.block_size,
            "dtype": str(model.dtype).removeprefix("torch.")}


def _model_dir(config: VllmConfig) -> str:
    """The local directory of the engine's checkpoint (a hub id is found in the local cache)."""
    model = config.model_config.model
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download
    return snapshot_download(model, revision=config.model_config.revision, local_files_only=True)
