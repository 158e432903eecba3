"""The shape of one episode: how many turns, how long a reply, how much of an email, how many results.

One place for these defaults. Training saves the shape with the run (`run_config.json`, key "episode"),
and evaluation and `ask` play a trained run with the shape it was trained on unless flags say otherwise:
a model trained on 4-turn, 64-token episodes is not judged on 10-turn, 1,024-token ones by accident.
Kept free of heavy imports so both command lines can use it at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from email_agent.agent.tools import DEFAULT_MAX_BODY_CHARS, DEFAULT_SEARCH_RESULTS


@dataclass(frozen=True)
class EpisodeShape:
    max_turns: int = 10  # agent turns per question
    max_tokens: int = 1024  # tokens per model reply
    max_body_chars: int = DEFAULT_MAX_BODY_CHARS  # read_email cuts longer bodies
    search_results: int = DEFAULT_SEARCH_RESULTS  # results per search when the model does not ask for a number

    def override(self, **given) -> "EpisodeShape":
        """This shape with the given fields replaced; None means "not given"."""
        return replace(self, **{k: v for k, v in given.items() if v is not None})

    @classmethod
    def from_run_config(cls, config: dict) -> "EpisodeShape":
        """The shape a run was trained with: its "episode" entry, else (older runs) its top-level flags."""
        saved = config.get("episode") or config
        return cls(**{f.name: saved[f.name] for f in fields(cls) if saved.get(f.name) is not None})

    def describe(self) -> str:
        return (f"{self.max_turns} turns, {self.max_tokens} tokens/reply, {self.max_body_chars} body chars, "
                f"{self.search_results} results/search")
