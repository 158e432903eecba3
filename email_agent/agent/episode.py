"""One episode: its limits (how many turns, how long a reply, how much of an email, how many results) and how
it is scored (the reward mode, the judge, what a wrong answer costs, the grounding check).

The one owner of both: training, the warm start, evaluation, `ask` and `serve` each hold an `Episode` and hand
it to `rollout`. Training saves the limits with the run (`run_config.json`, key "episode"), and evaluation and
`ask` play a trained run with the limits it was trained on unless flags say otherwise: a model trained on
4-turn, 64-token episodes is not judged on 10-turn, 1,024-token ones by accident; the scoring is the
evaluation's own. Kept free of heavy imports so both command lines can use it at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from email_agent.agent.tools import DEFAULT_MAX_BODY_CHARS, DEFAULT_SEARCH_RESULTS



def _limit(default: int, meaning: str, in_prompt: bool = True):
    """One of the episode's limits: what a run saves, a report shows and each command line takes as a flag
    (`meaning` is its help); `in_prompt`: it changes the prompt or the tool replies."""
    return field(default=default, metadata={"meaning": meaning, "in_prompt": in_prompt})


@dataclass(frozen=True)
class Episode:
    # the limits
    max_turns: int = _limit(10, "agent turns per question")
    max_tokens: int = _limit(1024, "tokens per model reply", in_prompt=False)
    max_body_chars: int = _limit(DEFAULT_MAX_BODY_CHARS, "read_email cuts longer bodies")
    search_results: int = _limit(DEFAULT_SEARCH_RESULTS, "results per search when the model does not ask for a number")
    # the scoring
    reward: str = "offline"  # see rewards.REWARD_MODES
    judge: object | None = None  # an `llm_judge.LLMJudge`; None: graded offline (by the matcher)
    hallucination_penalty: float = 1.0  # what a wrong answer costs in the shaped reward (rewards.shaped_reward)
    grounded_answers: bool = False  # withhold answers naming what the agent never saw (`grading.withhold_ungrounded`)

    def limits(self) -> dict:
        """The limits by name: what run_config.json saves and the evaluation records."""
        return {name: getattr(self, name) for name in LIMITS}

    def override(self, **given) -> Episode:
        """This episode with the given fields replaced; None means "not given"."""
        return replace(self, **{k: v for k, v in given.items() if v is not None})

    def scored(self, other: Episode) -> Episode:
        """This episode's limits, scored as `other` is."""
        return replace(other, **self.limits())

    @classmethod
    def from_run_config(cls, config: dict) -> Episode:
        """The limits a run was trained with: its "episode" entry, else (older runs) its top-level flags."""
        saved = config.get("episode") or config
        return cls(**{name: saved[name] for name in LIMITS if saved.get(name) is not None})

    @classmethod
    def with_limits_of(cls, settings) -> Episode:
        """An episode with the limits `settings` holds as attributes (a TrainConfig, parsed flags), scored by
        default."""
        return cls(**{name: getattr(settings, name) for name in LIMITS})

    def describe(self) -> str:
        return (f"{self.max_turns} turns, {self.max_tokens} tokens/reply, {self.max_body_chars} body chars, "
                f"{self.search_results} results/search")


LIMITS = tuple(f.name for f in fields(Episode) if "meaning" in f.metadata)  # what a run saves and a report shows
PROMPT_LIMITS = tuple(f.name for f in fields(Episode) if f.metadata.get("in_prompt"))  # what the prompt and tools see
MEANINGS = {f.name: f.metadata["meaning"] for f in fields(Episode) if f.name in LIMITS}  # each limit flag's help
