"""Training: the loop (`loop.train`, the `train` command) and what it calls between gathering rollouts and a
backend's update.

Modules, in the order a run flows through them:
  run_plan       the start-up checks, then the run resolved before anything loads (`resolve` -> the `Plan`)
  loop           the training loop, read top to bottom: gather, judge, train, log, validate
  judge_outages  a step's groups judged before they are trained on: a judge that is down is waited for, one that
                 stays down stops the run
  step_health    can GRPO learn from a step's groups, and did it: the first step's verdict, each step's line
  training_data  trajectories as the policy was served (tool arguments in the server's form), for every backend
  warm_start     supervised fine-tuning before RL, on the episodes `agent.demonstrations` gathers
"""
