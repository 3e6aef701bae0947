"""The engine arguments of the pinned vLLM: every field name of its ``vllm.EngineArgs``, names only.

Written down from vLLM 0.11.1's ``vllm/engine/arg_utils.py`` (the ``EngineArgs`` dataclass, its
annotated fields in source order; the release's wheel from PyPI, ``vllm-0.11.1-cp38-abi3-manylinux1_x86_64``);
vLLM 0.11.2's file has the same fields, in the same order. ``pyproject.toml``'s ``vllm`` extra pins
:data:`VLLM_REQUIREMENT`, so ``fleetbatch engine serve --vllm-arg KEY=VALUE`` checks KEY against the vLLM
it runs with. To move the pin: read the new release's ``EngineArgs`` fields, replace :data:`ENGINE_ARGS`
and both version constants (``tests/test_vllm_args.py`` checks the pin and the list agree in form).
"""

from __future__ import annotations

#: the vLLM releases the list was written for
VLLM_VERSIONS: tuple[str, ...] = ("0.11.1", "0.11.2")
#: the ``vllm`` extra's requirement in pyproject.toml
VLLM_REQUIREMENT = "vllm>=0.11.1,<0.12"

#: every ``vllm.EngineArgs`` field of those releases
ENGINE_ARGS: frozenset[str] = frozenset(
    {
        "model", "served_model_name", "tokenizer", "hf_config_path", "runner", "convert", "task",
        "skip_tokenizer_init", "enable_prompt_embeds", "tokenizer_mode", "trust_remote_code",
        "allowed_local_media_path", "allowed_media_domains", "download_dir", "safetensors_load_strategy",
        "load_format", "config_format", "dtype", "kv_cache_dtype", "seed", "max_model_len",
        "cuda_graph_sizes", "cudagraph_capture_sizes", "max_cudagraph_capture_size",
        "distributed_executor_backend", "pipeline_parallel_size", "master_addr", "master_port", "nnodes",
        "node_rank", "tensor_parallel_size", "decode_context_parallel_size", "dcp_kv_cache_interleave_size",
        "data_parallel_size", "data_parallel_rank", "data_parallel_start_rank", "data_parallel_size_local",
        "data_parallel_address", "data_parallel_rpc_port", "data_parallel_hybrid_lb",
        "data_parallel_external_lb", "data_parallel_backend", "enable_expert_parallel", "all2all_backend",
        "enable_dbo", "dbo_decode_token_threshold", "dbo_prefill_token_threshold",
        "disable_nccl_for_dp_synchronization", "eplb_config", "enable_eplb", "expert_placement_strategy",
        "_api_process_count", "_api_process_rank", "num_redundant_experts", "eplb_window_size",
        "eplb_step_interval", "eplb_log_balancedness", "max_parallel_loading_workers", "block_size",
        "enable_prefix_caching", "prefix_caching_hash_algo", "disable_sliding_window",
        "disable_cascade_attn", "swap_space", "cpu_offload_gb", "gpu_memory_utilization",
        "kv_cache_memory_bytes", "max_num_batched_tokens", "max_num_partial_prefills",
        "max_long_partial_prefills", "long_prefill_token_threshold", "max_num_seqs", "max_logprobs",
        "logprobs_mode", "disable_log_stats", "aggregate_engine_logging", "revision", "code_revision",
        "hf_token", "hf_overrides", "tokenizer_revision", "quantization", "enforce_eager",
        "disable_custom_all_reduce", "limit_mm_per_prompt", "enable_mm_embeds", "interleave_mm_strings",
        "media_io_kwargs", "mm_processor_kwargs", "disable_mm_preprocessor_cache", "mm_processor_cache_gb",
        "mm_processor_cache_type", "mm_shm_cache_max_object_size_mb", "mm_encoder_tp_mode",
        "mm_encoder_attn_backend", "io_processor_plugin", "skip_mm_profiling", "video_pruning_rate",
        "enable_lora", "max_loras", "max_lora_rank", "default_mm_loras", "fully_sharded_loras",
        "max_cpu_loras", "lora_dtype", "lora_extra_vocab_size", "ray_workers_use_nsight",
        "num_gpu_blocks_override", "num_lookahead_slots", "model_loader_extra_config", "ignore_patterns",
        "enable_chunked_prefill", "disable_chunked_mm_input", "disable_hybrid_kv_cache_manager",
        "structured_outputs_config", "reasoning_parser", "reasoning_parser_plugin",
        "guided_decoding_backend", "guided_decoding_disable_fallback",
        "guided_decoding_disable_any_whitespace", "guided_decoding_disable_additional_properties",
        "logits_processor_pattern", "speculative_config", "show_hidden_metrics_for_version",
        "otlp_traces_endpoint", "collect_detailed_traces", "scheduling_policy", "scheduler_cls",
        "pooler_config", "override_pooler_config", "compilation_config", "worker_cls",
        "worker_extension_cls", "kv_transfer_config", "kv_events_config", "ec_transfer_config",
        "generation_config", "enable_sleep_mode", "override_generation_config", "model_impl",
        "override_attention_dtype", "calculate_kv_scales", "mamba_cache_dtype", "mamba_ssm_cache_dtype",
        "mamba_block_size", "additional_config", "use_tqdm_on_load", "pt_load_map_location",
        "enable_multimodal_encoder_data_parallel", "logits_processors", "async_scheduling",
        "stream_interval", "kv_sharing_fast_prefill", "kv_offloading_size", "kv_offloading_backend",
        "tokens_only",
    }
)  # fmt: skip
