"""The project's one user error: `UserError`, a problem with the user's input, files or setup, worded for the user.

The command lines print its message as one line and exit 1 (`cli.run_command`); anything else is a bug and
keeps its traceback. Kept apart from every stage so that any module can raise it without importing another.
"""


class UserError(Exception):
    """A problem the user can act on (their input, files or database; a vLLM server that does not answer, a run
    another process holds), worded for the user: one sentence, no traceback."""
