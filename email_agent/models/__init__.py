"""Models opened to play episodes: what the evaluation, `ask` and `serve` all use, so none of them imports another.

Modules:
  opened   each --model resolved into an opened model served the way it was trained (a run on its backend's
           servers, `base`, or a prompted provider/model), checked and probed before it plays, and who plays when
  servers  the servers one evaluation (or `ask`, `serve`) holds: one vLLM server per base model for runs served on
           this machine, ART's backend per run trained on an ART backend
"""
