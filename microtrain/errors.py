"""The one exception type that the command lines turn into `Error: ...` lines."""


class UserError(Exception):
    """Bad input: the message names the file and what is wrong with it."""

    def __init__(self, path, problem: str):
        super().__init__(f"{path}: {problem}" if path else problem)
