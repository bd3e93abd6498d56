"""The error a model file, checkpoint directory or its config gets when it cannot be used (pure
Python, imported by every layer that reads model files: the tokenizer, the models, the CLI).

A model file is untrusted input: every refusal is one line that names the file, the item
(a metadata key, a tensor, a config field) and what is wrong with it.  The CLI prints that
line and exits nonzero, without a traceback (docs/model-files.md).
"""

from __future__ import annotations

from pathlib import Path


class ModelFileError(ValueError):
    """A model file that is damaged, inconsistent or asks for what the engine does not run."""

    def __init__(self, path: Path | str, item: str | None, problem: str) -> None:
        self.path = Path(path)
        self.item = item
        self.problem = problem
        where = f"{self.path.name}: {item}: " if item else f"{self.path.name}: "
        # One line, whatever the file put in the item's name or value.
        super().__init__(" ".join(f"{where}{problem}".split()))


def describe_file_kind(mode: int) -> str:
    """What a non-regular file-system object is, for the error that refuses it."""
    import stat

    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"
