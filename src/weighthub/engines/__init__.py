"""Serving-engine integrations: drive a receiver from inside an engine's workers.

    vllm   vLLM worker extension (`WeighthubWorker`; bind / stage / refit through collective_rpc)
    warm   `warm_kernels`: the codec kernels compiled or loaded once per process, before the
           first refit (engine binds and the Ray integration's publishers call it)

Placement of canonical tensors into an engine's parameters stays in `targets` (vllm_engine,
vllm_placement, vllm_copies); these modules sit above the receiver. Submodules are imported
explicitly: importing vLLM costs seconds.
"""
