"""The inference fleet: generation backends behind `GenerationInterface`.

- `interfaces`: `GenerationInterface` (the seam) and `GenerationSample` (one finished sample).
- `config`: `GenerationConfig`, the `generation` YAML section.
- `vllm_generation`: `VllmGeneration`, vLLM's V1 async engine in Ray actors (imports vLLM lazily).
- `vllm_engine_actor`: `VllmEngineActor` (one vLLM engine in a Ray actor) and `EngineClient`.
- `vllm_memory_budget`: the engines' memory budget and vLLM's KV-memory refusals as config errors.
- `vllm_worker_extension`: the class vLLM mixes into its worker processes (weight updates).

Importing this package imports neither vLLM nor Ray; import the modules themselves.
"""
