"""Evaluation beyond `clover eval-demo`: an lm-evaluation-harness model (`lm_eval_model`, imports
lm-eval), the demo tasks as lm-eval tasks (`lm_eval_tasks/`, `demo_tasks`) and the accuracy-speed
sweep (`sweep`, imports matplotlib). Nothing here is imported by `import clover`."""

from pathlib import Path

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"   # pass to lm-eval as --include_path

__all__ = ["TASKS_DIR"]
