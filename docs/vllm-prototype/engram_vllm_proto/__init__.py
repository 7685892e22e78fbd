def register() -> None:
    """vllm.general_plugins entry point: runs in every vLLM process (may run more than once)."""
    from vllm import ModelRegistry
    if "EngramLlamaForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("EngramLlamaForCausalLM", "engram_vllm_proto.model:EngramLlamaForCausalLM")
    import os
    log = os.environ.get("ENGRAM_PROTO_LOG")
    if log:  # test aid: record preemptions (the scheduler runs in the engine-core process)
        from vllm.v1.core.sched import scheduler as S
        if not getattr(S.Scheduler, "_engram_proto_patched", False):
            orig = S.Scheduler._preempt_request

            def _preempt(self, request, *a, **kw):
                with open(log, "a") as f:
                    f.write('{"kind": "preempt", "req": "%s"}\n' % request.request_id)
                return orig(self, request, *a, **kw)

            S.Scheduler._preempt_request = _preempt
            S.Scheduler._engram_proto_patched = True
