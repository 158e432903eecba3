"""Email search agents trained with reinforcement learning (the ART·E recipe).

Modules, in the order data flows through them:
data (sources, schema, build, read-only access) -> questions -> tools -> rollout -> grading -> rewards
-> backends (CPU trainer/server; ART's GPU backends) -> report.
"""

import os

# litellm (imported by ART) downloads a price table at import time unless told not to; we run offline.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
