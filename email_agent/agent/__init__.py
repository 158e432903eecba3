"""The agent's episode: the shape it plays, its tools, the rollout, and how an episode is scored.

Modules, in the order an episode flows through them:
  episode   `Episode`: turns, reply length, email length, results per search (saved with each run)
  tools     search_inbox, read_email, return_final_answer over an `EmailDB`
  rollout   one async function: a question played by a policy through the tools, returning an ART Trajectory
  rewards   grading (offline match, an LLM judge, RULER) and the shaped reward GRPO learns from
  expert    the scripted expert the warm start imitates, played through the same rollout
"""
