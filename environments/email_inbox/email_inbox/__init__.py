"""The email search agent's task for verifiers: `vf-eval email-inbox` (docs/verifiers.md).

verifiers finds a taskset by the package's `__all__`: its Taskset subclass, and here also the Env that plays it
with the project's episode limits, on this machine, by default.
"""

from email_inbox.taskset import EmailInboxEnv, EmailInboxTaskset

__all__ = ["EmailInboxTaskset", "EmailInboxEnv"]
