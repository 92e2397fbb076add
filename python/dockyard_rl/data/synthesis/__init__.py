"""SWE task synthesis (SWE-smith style, no model needed) and task-set validation.

- `sdist_repos`: Python source distributions as local git repositories.
- `mutations`: procedural bug-introducing mutations of Python source.
- `holdout`: removing a task's FAIL_TO_PASS tests from the repository the agent sees.
- `problem_statements`: problem statements written from the failing tests.
- `task_synthesis`: one package -> validated tasks; `TaskSynthesisConfig` (a recipe's `synthesis`
  section).
- `synthesize_swe_tasks`: the synthesizer's command line, and `synthesize` (GRPO setup).
- `validate_swe_tasks`: the command line that checks a task set against an executor.
- `bundled_sdists`: the bundled toy packages (`bundled:toystats`, ...) for tests and recipes.

The training loop's data path (schema, loaders, the `data` config, prompts, patch formats) is the
parent package, `dockyard_rl.data`.
"""
