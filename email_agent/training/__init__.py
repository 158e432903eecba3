"""What the training loop in train_email_search_agent.py calls between gathering rollouts and a backend's update.

Modules, in the order a step flows through them:
  judge_outages  a step's groups judged before training: a judge that is down is waited for, one that stays down
                 stops the run
  step_health    can GRPO learn from a step's groups, and did it: the first step's verdict, each step's line
  training_data  trajectories as the policy was served (tool arguments in the server's form), for every backend
  warm_start     supervised fine-tuning on the expert's (or a teacher's) episodes before RL
"""
