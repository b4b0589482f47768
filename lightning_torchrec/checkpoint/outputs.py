"""Where the command lines write: never into their input, never over a file unasked, no leftovers.

``python -m lightning_torchrec.consolidate`` and ``python -m lightning_torchrec.export`` read a
checkpoint directory and write a file. :func:`check_output` refuses an output inside (or equal
to) the checkpoint, which would overwrite ``meta.pt`` or the manifest, and an existing output
unless ``--overwrite``. :class:`OwnedTemp` writes into a temporary file it created itself (a
fresh name, never someone's ``OUT.partial``), moves it into place at the end and deletes it on
any failure, so a failed command leaves nothing behind. :func:`user_error` is the one-line
message a command prints (exit status 2) for a mistake the user can fix.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from types import TracebackType
from typing import NoReturn

from lightning_torchrec.checkpoint.paths import is_inside


def check_output(checkpoint: str | Path, output: str | Path, overwrite: bool) -> None:
    """Refuses an output inside or equal to the checkpoint, or an existing one unless asked.

    Args:
        checkpoint: the input checkpoint directory.
        output: the file to write.
        overwrite: whether an existing output file may be replaced.

    Raises:
        ValueError: if the output is the checkpoint or inside it (symlinks resolved).
        FileExistsError: if the output exists (and ``overwrite`` is False), or is a directory.
    """
    checkpoint, output = Path(checkpoint), Path(output)
    if os.path.realpath(output) == os.path.realpath(checkpoint) or is_inside(output, checkpoint):
        raise ValueError(
            f"the output {output} is inside the checkpoint {checkpoint} it is made from; "
            "writing it would change the checkpoint. Write it elsewhere."
        )
    if output.is_dir():
        raise FileExistsError(f"the output {output} is a directory; name a file")
    if (output.exists() or output.is_symlink()) and not overwrite:
        raise FileExistsError(
            f"the output {output} exists; pass --overwrite to replace it, or name another file"
        )


class OwnedTemp:
    """A temporary file beside ``output`` that becomes ``output`` on success, else vanishes.

    Use as a context manager; write to :attr:`path`. The file is created exclusively (a fresh
    random name), so nothing that existed is ever overwritten or deleted by it; the output gets
    the mode of any new file (``0666`` less the umask).

    Args:
        output: the final file.
    """

    def __init__(self, output: str | Path) -> None:
        self.output = Path(output)
        self.output.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(
            dir=self.output.parent, prefix=f".{self.output.name}.", suffix=".partial"
        )
        os.close(fd)
        self.path = Path(name)

    def __enter__(self) -> OwnedTemp:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is None:
            # mkstemp makes the file private (0600); the output gets the usual mode of a new
            # file (0666 less the umask), so a server run by another account can read it.
            umask = os.umask(0o022)
            os.umask(umask)
            self.path.chmod(0o666 & ~umask)
            os.replace(self.path, self.output)
        else:
            self.path.unlink(missing_ok=True)


def one_line(err: BaseException) -> str:
    """An error's message on one line.

    Args:
        err: the error.

    Returns:
        ``"Type: message"`` with its lines joined.
    """
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return f"{type(err).__name__}: {text}"


def user_error(parser: argparse.ArgumentParser, err: BaseException) -> NoReturn:
    """Exits a command with status 2 and the error on one line (no traceback).

    Args:
        parser: the command's parser.
        err: the error.
    """
    parser.exit(2, f"{parser.prog}: error: {one_line(err)}\n")


#: What a command reports as a user's mistake (the checkpoint, the paths, the arguments)
#: rather than as a bug: every error of the checkpoint modules is one of these.
USER_ERRORS = (ValueError, TypeError, ImportError, OSError)
