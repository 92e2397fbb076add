"""The inference fleet: generation backends behind `GenerationInterface`.

- `interfaces`: `GenerationInterface` (the seam) and `GenerationSample` (one finished sample).
- `config`: `GenerationConfig`, the `generation` YAML section.
- `vllm_worker`: `VllmGeneration`, vLLM's V1 async engine in Ray actors (imports vLLM lazily).
- `vllm_worker_extension`: the class vLLM mixes into its worker processes (weight updates).

Importing this package imports neither vLLM nor Ray; import the modules themselves.
"""
