"""Email search agents trained with reinforcement learning (the ART·E recipe).

One folder per stage, in the order data flows through them:
  data/        the inbox: mail exports read, the database built (build-db), questions written and split
  agent/       one episode: the tools, the rollout, whether its answer is right (matcher, LLM judge, RULER), rewards
  training/    a run planned, then trained: warm start, the GRPO loop, each step's health, judge outages
  backends/    where a run trains: the CPU trainer beside vLLM, ART's GPU and hosted backends, readiness
  models/      models opened to play episodes, for the evaluation, `ask` and `serve`
  evaluation/  an evaluation's records, figures and report
  apps/        a trained agent put to use: ask, serve (MCP), export
Beside them, what they share: errors (UserError), cli, settings, config (training's), eval_config (the
evaluation's), runs (a run's folder), results_file (an evaluation's results.jsonl), model_api (calls to a model
API and their one retry policy), redact, tracing, dashboard. docs/development.md maps every module.
"""

import os

# litellm (imported by ART) downloads a price table at import time unless told not to; we run offline.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
