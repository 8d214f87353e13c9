"""Install score-based eviction on a running ``vllm.LLM`` (a small, versioned patch).

What a ``vllm.general_plugins`` entry point can reach (registering an attention backend) is not
enough: the blocks a request holds are decided by the scheduler's KV cache manager, and the
slots new tokens go to by the model runner's input preparation. So the hooks are installed on
the live objects of one engine, and only on the vLLM versions they were written against
(``SUPPORTED``): every hooked method's behaviour is pinned by ``tests/test_vllm_evict.py``.

* ``llm_kwargs(kv, cpu)``: what ``LLM(...)`` must be built with: prefix caching off (compacted
  blocks hold no prompt prefix anyone else could share), synchronous scheduling (the runner
  compacts at the start of the step the scheduler planned, before the next step is scheduled)
  and, on GPU, piecewise CUDA graphs (attention outside the graphs).
* ``install(llm, kv, trace)``: runner hooks through ``collective_rpc`` (``worker.py``), scheduler
  hooks on the in-process engine core (``scheduler.py``). Tensor parallelism is refused: each
  worker would need the same kept sets (scores reduced across the heads it holds).
"""
from __future__ import annotations

from actors.config import KVConfig

SUPPORTED = ("0.32.",)


def check_version() -> str:
    import vllm

    if not vllm.__version__.startswith(SUPPORTED):
        raise RuntimeError(f"KV eviction hooks are written for vLLM {' / '.join(SUPPORTED)}x, "
                           f"this is {vllm.__version__}: re-check actors/vllm/evict against it "
                           "(tests/test_vllm_evict.py) before extending SUPPORTED")
    return vllm.__version__


def llm_kwargs(kv: KVConfig, cpu: bool) -> dict:
    """On GPU, CUDA graphs only around the layers' dense parts (``PIECEWISE``): attention runs
    eagerly, so the hooked ``impl.forward`` observes every step (a full graph would replay the
    kernel without it)."""
    kw = {"enable_prefix_caching": False, "async_scheduling": False}
    if not cpu:
        kw["compilation_config"] = {"cudagraph_mode": "PIECEWISE"}
    return kw


def install_worker(worker, kv: KVConfig, trace: bool) -> int:
    """Runs in every worker (``collective_rpc``): wrap the runner's ``execute_model`` and
    ``_prepare_inputs`` and each attention layer's ``impl.forward``. Returns the layer count."""
    from actors.vllm.evict.worker import Evictor

    runner = worker.model_runner
    ev = Evictor(runner, kv, trace)
    runner.sparse_rl_evictor = ev
    execute, prepare = runner.execute_model, runner._prepare_inputs

    def execute_model(scheduler_output, *args, **kwargs):
        ev.before_step(scheduler_output)
        try:
            return execute(scheduler_output, *args, **kwargs)
        finally:
            ev.plan = None        # dummy and profiling runs observe nothing

    def prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
        out = prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)
        ev.after_prepare(num_scheduled_tokens)
        return out

    runner.execute_model, runner._prepare_inputs = execute_model, prepare_inputs
    for i, layer in enumerate(ev.layers):
        def forward(attn_layer, query, *args, _i=i, _forward=layer.impl.forward, **kwargs):
            out = _forward(attn_layer, query, *args, **kwargs)
            ev.observe(_i, query)
            return out

        layer.impl.forward = forward
    return len(ev.layers)


def take_traces(worker, req_ids: list[str]) -> dict:
    return worker.model_runner.sparse_rl_evictor.take_traces(req_ids)


def install(llm, kv: KVConfig, trace: bool = False):
    """Hook an ``LLM`` built with ``llm_kwargs(kv)``; returns the scheduler side (its
    ``freed_blocks`` counts blocks returned to the pool by compactions)."""
    from actors.vllm.evict.scheduler import SchedulerEviction

    check_version()
    llm.collective_rpc(install_worker, args=(kv, trace))
    core = llm.llm_engine.engine_core.engine_core          # in-process EngineCore
    return SchedulerEviction(core.scheduler, kv)


def traces(llm, req_ids: list[str]) -> dict:
    """The native-format trace of each request (rank 0's; every rank keeps the same sets)."""
    return llm.collective_rpc(take_traces, args=(list(req_ids),))[0]
