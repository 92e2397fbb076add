"""SWE task data: the instance schema, dataset loaders and registries, the `data` config section,
prompt processors and the model-output patch formats, and the SWE-smith-style task synthesizer
(sdist_repos, mutations, test_holdout, problem_statements, task_synthesis,
synthesize_swe_tasks)."""
