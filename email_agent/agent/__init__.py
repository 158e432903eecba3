"""The agent's episode: the limits it plays in, its tools, the rollout, and how an episode is scored.

Modules, in the order an episode flows through them:
  episode   `Episode`: turns, reply length, email length, results per search (saved with each run)
  tools     search_inbox, read_email, return_final_answer over an `EmailDB`, and the dispatch of every call
  rollout   one async function: a question played by a policy through the tools, returning an ART Trajectory
  matcher   the offline grader: is an answer right, from the gold answer's core and the question's text alone
  llm_judge the LLM judge: is an answer right, asked of a model (its prompt, its reply parsed, its verdicts cached)
  ruler     RULER's judge: a group's trajectories scored against each other, each score matched by id
  grading   is the answer right (the LLM judge, or the matcher without one), the grounding check, and an
            episode's answer graded (and graded again: the train loop after a judge outage, `--rejudge`)
  rewards   the Rubric turned into a number: the shaped and binary rewards, RULER's scores as a group's rewards
  expert    the scripted expert the warm start imitates, played through the same rollout
  demonstrations  the episodes the warm start imitates: the expert's, or a teacher's from an evaluation folder
"""
