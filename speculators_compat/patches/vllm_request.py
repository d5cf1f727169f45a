"""vLLM ``Request`` construction, for any hand-built engine loop (upstream's, ours, a user's).

Two breaks, two patches:

* ``vllm_request_eos`` (vLLM 0.17+): ``Request.__init__`` lost ``eos_token_id``; passing it raises
  TypeError. The wrapper drops it and records it on the sampling params instead
  (``SamplingParams.update_from_generation_config({}, eos_token_id=...)``), where 0.17+ reads it.
* ``vllm_request_block_hasher`` (vLLM 0.12+): prefix caching is on by default, and a Request built
  without ``block_hasher`` then crashes the scheduler (AssertionError in ``cache_full_blocks``,
  IndexError from 0.28; 0.33 caches only the blocks a request has hashes for, so there it is never
  cached instead). The wrapper records every Scheduler whose KV-cache manager caches prefixes, and
  supplies the block hasher vLLM would give its own requests (same hash block size, algorithm and,
  from 0.33, look-ahead tokens) to Requests built without one. Our own engine turns prefix caching
  off (a cache hit skips computing, so nothing would be captured); this keeps other hand-built
  loops alive.
"""

from __future__ import annotations

import logging

from ..engine.requests import active_block_hasher, build_request, caching_schedulers, request_params, set_eos
from ..registry import Patch

logger = logging.getLogger("speculators_compat")

__all__ = ["RequestPatch", "build_request"]


class RequestPatch(Patch):
    name = "vllm_request"
    module = "vllm.v1.core.sched.scheduler"
    targets = ("vllm.v1.request:Request.__init__", "vllm.v1.core.sched.scheduler:Scheduler.__init__")
    package = "vllm"
    versions = ">=0.12"
    process = "driver"
    risk = (
        "medium: reads Scheduler.kv_cache_manager.enable_caching, hash_block_size/block_size and "
        "calls get_request_block_hasher(block_size, hash_fn[, num_hash_lookahead_tokens]); "
        "Request gained only optional parameters since 0.17"
    )
    description = (
        "0.12+: supply the block hasher a prefix-caching scheduler needs to Requests built "
        "without one (else AssertionError/IndexError in cache_full_blocks; 0.33: never "
        "cached); 0.17+: drop Request(eos_token_id=) (TypeError) and set it on the sampling "
        "params instead"
    )
    test = (
        "tests/engine/test_patches_engine.py::test_request_patch_block_hasher, "
        "tests/engine/test_patches_engine.py::test_request_patch_eos"
    )

    def needed(self, module):
        from vllm.v1.request import Request

        params = request_params(Request)
        parts = []
        if "block_hasher" in params:
            parts.append(
                "Request(block_hasher=None) is never hashed: a prefix-caching scheduler "
                "crashes on it (0.12-0.32) or never caches it (0.33)"
            )
        if "eos_token_id" not in params:
            parts.append("Request has no eos_token_id parameter")
        return "; ".join(parts) or None

    def _apply(self, module):
        from vllm.v1 import request as request_mod

        params = request_params(request_mod.Request)
        drop_eos = "eos_token_id" not in params
        supply_hasher = "block_hasher" in params

        def sched_init(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            mgr = getattr(instance, "kv_cache_manager", None)
            if getattr(mgr, "enable_caching", False):
                bs = getattr(instance, "hash_block_size", None) or getattr(instance, "block_size", None)
                if bs is None:
                    bs = instance.cache_config.block_size
                algo = getattr(instance.cache_config, "prefix_caching_hash_algo", "sha256")
                lookahead = getattr(getattr(instance, "vllm_config", None), "num_hash_lookahead_tokens", 0)
                caching_schedulers[instance] = (int(bs), algo, int(lookahead or 0))
            return result

        def req_init(wrapped, instance, args, kwargs):
            if drop_eos and "eos_token_id" in kwargs:
                eos = kwargs.pop("eos_token_id")
                if eos is not None:
                    set_eos(kwargs.get("sampling_params", args[2] if len(args) > 2 else None), eos)
            if supply_hasher and kwargs.get("block_hasher") is None:
                hasher = active_block_hasher()
                if hasher is not None:
                    kwargs["block_hasher"] = hasher
            return wrapped(*args, **kwargs)

        self.wrap(module.Scheduler, "__init__", sched_init)
        self.wrap(request_mod.Request, "__init__", req_init)

    def _revert(self, module):
        self._unwrap_all()
        caching_schedulers.clear()
