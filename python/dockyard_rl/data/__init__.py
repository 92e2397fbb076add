"""SWE task data: the instance schema, dataset loaders and registries, the `data` config section,
the order of training prompts (`prompt_sampler`), prompt processors and the model-output patch
formats. The SWE-smith-style task synthesizer and the task-set validator are the `synthesis`
sub-package."""
