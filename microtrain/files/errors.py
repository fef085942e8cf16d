"""The errors that bad input raises, everywhere: loaders, kernels and rules alike.

Each carries the file it is about and, when one is to blame, the field within
it; only the command lines (cli_common.py) turn it into the one line
`Error: <file>: <field>: <problem>`.  Code that knows the file better than the
code that raised attaches it with `at`, never by parsing the message.
"""


class UserError(Exception):
    """Bad input: `path` names the file (None: not known where it was raised),
    `field` the field or entry in it (None: the file as a whole)."""

    def __init__(self, path, problem: str, field: str | None = None):
        super().__init__(problem)
        self.path, self.problem, self.field = path, problem, field

    def __str__(self) -> str:
        return ": ".join([str(p) for p in (self.path, self.field) if p] + [self.problem])

    def at(self, path) -> "UserError":
        """This error, naming `path` as its file unless it already names one."""
        if self.path is None:
            self.path = path
        return self


class ContractError(UserError):
    """A record stored in a file breaks its contract (microtrain/files/contracts.py):
    a missing or mistyped field, a value out of range, another version."""


class OperatorError(UserError):
    """An operator cannot run on its tensors or options (raised by kernels and by
    the executor, which names the file and the operator)."""


class TornSetError(UserError):
    """The files of one artifact set come from different runs of `trainconf split`."""
