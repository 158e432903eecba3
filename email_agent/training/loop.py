"""The training loop, read top to bottom: `train(cfg)` is the `train` command once its flags are checked.

    plan = resolve(cfg)          the start-up checks (data, machine, resume; flags before, by the command): all that
                                 can refuse the run, before it is saved or a model loads (run_plan)
    the run opened               backend made, run saved, model registered, the policy served
    --preflight                  the next step up to its update: gathered, judged, its verdict told; then it stops
    warm start                   SFT on the expert's or a teacher's episodes, when one is due (warm_start)
    each GRPO step:
        gather                   groups of rollouts of the step's questions, graded as each ends; answers a judge
                                 failed on while it was down graded again once it answers (judge_outages)
        measure                  what the groups offer GRPO (step_health); the first step says whether it can learn
        decide what trains       groups whose rewards spread less than --min-reward-std get their mean: no update
        update                   the backend's trainer, on the tokens as served (training_data.for_grpo)
        log                      model.log (history.jsonl, mirrored to TensorBoard), the step line, warnings
                                 (step_health, asked once after the update)
        validate                 every --eval-every steps and at the end; then the checkpoints kept

It owns the order of a run's calls and one choice of the algorithm, which groups train (the ALGO LOGIC banner in
`grpo`); not what the calls do: rollouts are `agent.rollout`'s, rewards `agent.rewards`', health numbers and the
verdict `step_health`'s, the update the backend trainer's.
"""

from __future__ import annotations

import math
import shutil
import statistics
import sys
import time
from dataclasses import replace

import art

from email_agent import backends, cli, dashboard, runs
from email_agent.agent import rewards
from email_agent.agent.rollout import Policy
from email_agent.config import DEMO_PRESET, TrainConfig, opening_lines
from email_agent.data.questions import Question
from email_agent.errors import UserError
from email_agent.training import judge_outages, run_plan, step_health, training_data, warm_start
from email_agent.training.run_plan import Plan


async def train(cfg: TrainConfig) -> None:
    """A training run, or its preflight (`cfg`'s flags already refused if no run can use them: run_plan.check_flags)."""
    plan = await run_plan.resolve(cfg)  # the start-up checks (data, machine, resume, grader): all that can refuse
    cfg = plan.config
    print("\n".join(opening_summary(plan)), file=sys.stderr)
    # fails here, before anything is saved, if it cannot run
    backend = plan.backend.make(plan.backend_settings)
    new_run = not plan.run_folder.exists()
    runs.start(plan.run_folder, plan.run_config, fresh=cfg.fresh, preflight=cfg.preflight)
    model = art.TrainableModel(name=cfg.name, project=cfg.project, base_model=cfg.base_model, base_path=cfg.art_dir,
                               report_metrics=["wandb"] if cfg.wandb else [],
                               _internal_config=plan.backend.model_config(plan.backend_settings))
    # every row ART logs from here on (warm start, steps, validations; any backend) reaches TensorBoard as it lands
    mirror = dashboard.Mirror(plan.run_folder).start() if cfg.tensorboard and not cfg.preflight else None
    try:
        await model.register(backend)
        # may reopen a warm start (deleted checkpoints)
        state = await runs.check_state(plan.run_folder, plan.state, model)
        policy = Policy.for_model(model, temperature=cfg.temperature, max_concurrency=cfg.concurrency)
        tokenizer = plan.backend.tokenizer(backend, cfg.base_model)  # None: a remote backend renders
        arguments = training_data.argument_form(tokenizer.chat_template if tokenizer else None)
        warm_start_pending = bool(cfg.sft_from) and not state.get("sft_done")
        # RL steps are counted after the warm start's checkpoints, so a resumed run finds its place in the data
        # (a warm start still to finish, even half done, comes before any RL step).
        sft_steps = state.get("sft_steps", 0)
        rl_step = 0 if warm_start_pending else await model.get_step() - sft_steps
        batches = art.utils.iterate_dataset(plan.rl_questions, groups_per_step=cfg.groups_per_step,
                                            num_epochs=cfg.num_epochs, initial_step=rl_step, use_tqdm=False)
        if cfg.preflight:  # the next step's groups from the policy as it is now: nothing trained, logged or saved
            return await preflight(plan, policy, next(iter(batches), None), sft_steps, warm_start_pending)
        if warm_start_pending:
            sft_steps = await run_warm_start(plan, model, policy, arguments)
        if not cfg.sft_only:
            await grpo(plan, model, backend, policy, batches, sft_steps, tokenizer, arguments)
    finally:
        await backend.close()
        if mirror is not None:
            mirror.close()
        if cfg.preflight and new_run:  # registering wrote a first checkpoint; a preflight leaves no run behind
            shutil.rmtree(plan.run_folder, ignore_errors=True)


async def grpo(plan: Plan, model: art.TrainableModel, backend, policy: Policy, batches, sft_steps: int, tokenizer,
               arguments: training_data.ArgumentForm) -> None:
    """GRPO's steps, each gathered, measured, trained on and logged, validated as due; then the checkpoints kept."""
    cfg = plan.config
    if plan.backend.on_this_cpu:
        await say_what_a_cpu_step_costs(plan, policy, backend.max_num_seqs)
    watch = step_health.Watch(cfg.temperature, cfg.max_seq_length)
    for batch in batches:
        if cfg.max_steps and batch.step >= cfg.max_steps:
            break
        step = batch.step + sft_steps
        if batch.step % cfg.eval_every == 0 and plan.val_questions and not (batch.step == 0 and sft_steps):
            print(await validate(plan, model, policy, step))
        started = time.perf_counter()
        # gather: a group of rollouts per question, graded as each ends (a judge that is down is waited for)
        groups = await gather_graded(plan, policy, batch.items, step)
        # measure: what the groups offer GRPO; a fresh run says at once whether it can learn
        health = step_health.measure(groups, time.perf_counter() - started, cfg.min_reward_std)
        if batch.step == 0:
            verdict = say_whether_it_can_learn(plan, health, warm_start_pending=False)
            if verdict.cannot_learn and not cfg.train_anyway:  # not hours of steps that learn nothing
                raise UserError(f"{verdict.headline.rstrip('.')}; stopped before its first update, with the run "
                                f"kept (rerun with the fix to go on from here, or add --train-anyway to train "
                                f"regardless).")
            print(f"{'' if verdict.ok else 'warning: '}{verdict.headline}", flush=True)
        # ---- ALGO LOGIC: decide what trains. Rewards that spread less than --min-reward-std are judge noise
        # (ART's std-scaled advantages would blow a 0.001 difference up to a full-size update): such a group
        # gets its mean reward for every rollout, so its advantages are zero and GRPO trains none of it (ART
        # still counts it as submitted). ----
        trained = [at_mean_reward(group) if reward_spread(group) < cfg.min_reward_std else group
                   for group in groups]
        # update: the backend's trainer, on exactly the tokens the policy was served and sampled
        result = await backend.train(model, training_data.for_grpo(trained, arguments, tokenizer),
                                     learning_rate=cfg.learning_rate, advantage_balance=cfg.advantage_balance,
                                     scale_rewards=cfg.scale_rewards)
        # log: what the update learned from, to history.jsonl (mirrored to TensorBoard), the step line, warnings
        step_report = watch.after_update(health, groups, result.metrics, result.step, time.perf_counter() - started)
        await model.log(groups, split="train", metrics={**result.metrics, **step_report.metrics}, step=result.step)
        policy.model = model.get_inference_name()  # serve the new checkpoint from the next rollout on
        print(step_report.line, flush=True)
        for warning in step_report.warnings:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    step = await model.get_step()
    if plan.val_questions:
        print(await validate(plan, model, policy, step))
    if cfg.keep_checkpoints == "best":
        await backends.keep_latest_and_best(model, backend, step, also=(sft_steps,) if sft_steps else ())
    print(f"done: {plan.run_folder} (step {step}); evaluate with "
          f"python test_email_search_agent.py --model {cfg.name}" + (" --demo" if cfg.demo else ""))


def reward_spread(group: art.TrajectoryGroup) -> float:
    """The population standard deviation of a group's rewards (inf for an empty group: nothing to flatten)."""
    rewards = [t.reward for t in group.trajectories]
    return statistics.pstdev(rewards) if rewards else math.inf


def at_mean_reward(group: art.TrajectoryGroup) -> art.TrajectoryGroup:
    """`group` with every rollout's reward set to the group's mean: GRPO's advantages are then all zero."""
    mean = sum(t.reward for t in group.trajectories) / len(group.trajectories)
    return group.model_copy(update={"trajectories": [t.model_copy(update={"reward": mean})
                                                     for t in group.trajectories]})


# ---- the run opened ------------------------------------------------------------------------------

def opening_summary(plan: Plan) -> list[str]:
    """What the run is about to do, for a person, at its start."""
    return opening_lines(plan.config, plan.backend.name, len(plan.train_questions),
                         len(plan.rl_questions) - len(plan.train_questions), len(plan.val_questions), plan.rl_steps,
                         plan.reward_line, warm_start_done=bool(plan.state.get("sft_done")))


# ---- a step up to its update: gather, regrade, can it learn ---------------------------------------

async def gather_graded(plan: Plan, policy: Policy, questions: list[Question], step: int
                        ) -> list[art.TrajectoryGroup]:
    """A step's groups gathered and graded: those a judge failed on while it was down are graded again once it
    answers (all of a step up to its measure that --preflight takes too)."""
    groups = await gather(plan, policy, questions, step)
    return await regrade_while_the_judge_is_down(plan, groups, step)


async def gather(plan: Plan, policy: Policy, questions: list[Question], step: int) -> list[art.TrajectoryGroup]:
    """A group of `rollouts_per_group` rollouts per question (RULER scores each group as it completes)."""
    return await art.gather_trajectory_groups(
        (art.TrajectoryGroup(plan.rollout(policy, q, plan.db, plan.episode)
                             for _ in range(plan.config.rollouts_per_group)) for q in questions),
        pbar_desc=f"step {step}", max_exceptions=0.5, max_metrics=4,
        after_each=plan.ruler.score if plan.ruler else None)


async def regrade_while_the_judge_is_down(plan: Plan, groups: list[art.TrajectoryGroup], step: int
                                          ) -> list[art.TrajectoryGroup]:
    """The groups the judge graded: one that is down is waited for while the rollouts are kept, one that stays
    down stops the run at this step (judge_outages); `plan.regrade` grades a failed group again."""
    return await judge_outages.settle(groups, plan.regrade, reward_mode=plan.episode.reward,
                                      patience=plan.config.judge_patience,
                                      step=step + 1,  # the number of the checkpoint it would make
                                      notify=lambda line: cli.print_progress(line, to_stderr=True))


def say_whether_it_can_learn(plan: Plan, health: step_health.Health, warm_start_pending: bool
                             ) -> step_health.Diagnosis:
    """Print what a step's groups offer GRPO and the verdict; returns the verdict."""
    cfg = plan.config
    verdict = step_health.diagnose(health, reward_mode=plan.episode.reward, sft_from=cfg.sft_from,
                                   warm_start_pending=warm_start_pending)
    space = runs.free_space_warning(plan.run_folder)
    print("\n".join(step_health.report(health, verdict, cfg.groups_per_step, cfg.rollouts_per_group, cfg.concurrency)
                    + ([f"  warning: {space}"] if space else [])), flush=True)
    return verdict


async def preflight(plan: Plan, policy: Policy, batch, sft_steps: int, warm_start_pending: bool) -> None:
    """--preflight: the next step up to its update, as `grpo` takes it (gathered, judged, the verdict printed);
    UserError if GRPO cannot learn from it."""
    if batch is None:
        raise UserError(f"--preflight: run {plan.config.name!r} has no steps left to check (its epochs are done).")
    started = time.perf_counter()
    groups = await gather_graded(plan, policy, batch.items, batch.step + sft_steps)
    health = step_health.measure(groups, time.perf_counter() - started, plan.config.min_reward_std)
    verdict = say_whether_it_can_learn(plan, health, warm_start_pending)
    if not verdict.ok:
        raise UserError(verdict.headline)
    print(f"preflight: {verdict.headline}")


# ---- validation, the warm start, a CPU step's cost ----------------------------------------------

async def validate(plan: Plan, model: art.TrainableModel, policy: Policy, step: int) -> str:
    """Greedy episodes of the validation questions, logged as val/*; returns the line to print."""
    greedy = replace(policy, temperature=0.0)  # as the evaluation does: less noise per question
    questions = plan.val_questions
    # One-episode groups because only gather_trajectory_groups takes max_metrics: gather_trajectories' bar
    # shows every metric (~20), a line that wraps and floods the terminal at each refresh. plan.rollout: traced
    # to Weave with --wandb, as training's episodes are.
    groups = await art.gather_trajectory_groups((art.TrajectoryGroup([plan.rollout(greedy, q, plan.db,
                                                                                   plan.episode)])
                                                 for q in questions),
                                                pbar_desc="validate", max_exceptions=len(questions), max_metrics=4)
    trajs = [t for g in groups for t in g.trajectories]
    extra = {"valid_tool_call_rate": rewards.valid_tool_call_rate(t.metrics for t in trajs) or 0.0}
    await model.log(trajs, split="val", metrics=extra, step=step)
    n = max(len(trajs), 1)
    right = sum(t.metrics["answer_correct"] for t in trajs) / n
    hallucinated = sum(t.metrics["hallucinated"] for t in trajs) / n
    return (f"val  {step:>4}  reward {sum(t.reward for t in trajs) / n:+.3f}  accuracy {right:.0%}  hallucination "
            f"{hallucinated:.0%}  valid calls {extra['valid_tool_call_rate']:.0%}  ({len(trajs)} questions, greedy)")


async def run_warm_start(plan: Plan, model: art.TrainableModel, policy: Policy,
                         arguments: training_data.ArgumentForm) -> int:
    """The run's warm start (SFT on the expert's or a teacher's episodes), marked done in its state, then a
    validation; returns its last step."""
    cfg = plan.config
    await warm_start.fine_tune(cfg, model, training_data.for_sft(plan.sft_episodes, arguments),
                               say=cli.print_progress)
    state = model.merge_state({"sft_done": True, "sft_steps": await model.get_step()})
    policy.model = model.get_inference_name()
    if plan.val_questions:
        print(await validate(plan, model, policy, await model.get_step()))
    return state["sft_steps"]


async def say_what_a_cpu_step_costs(plan: Plan, policy: Policy, max_num_seqs: int) -> None:
    """GPU-scale steps on a CPU: one rollout timed, and what a step of them will cost, said before the first."""
    cfg = plan.config
    rollouts = cfg.groups_per_step * cfg.rollouts_per_group
    preset_rollouts = DEMO_PRESET["groups_per_step"] * DEMO_PRESET["rollouts_per_group"]
    if rollouts > preset_rollouts:
        started = time.perf_counter()
        await plan.rollout(policy, plan.rl_questions[0], plan.db, plan.episode)
        print(step_health.cpu_step_note(time.perf_counter() - started, rollouts, min(cfg.concurrency, max_num_seqs),
                                        preset_rollouts), file=sys.stderr, flush=True)
