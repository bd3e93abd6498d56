"""The environment of a Python process pagedllm starts (a tensor-parallel rank, a replica's server).

`python -m pagedllm...` puts the working directory first on `sys.path`.  From the folder that
holds a clone (`~` with `~/pagedllm`), that folder is a namespace package named `pagedllm`,
and with an editable install (found through a finder that Python consults after `sys.path`) it
is imported instead of the real package.  A child's PYTHONPATH therefore leads with the folder
that holds the package its parent runs, so it runs the same one from any working directory.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


def child_environment(**extra: str) -> dict[str, str]:
    """This process's environment, PYTHONPATH led by this package's folder, with `extra` set."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_PARENT, os.environ.get("PYTHONPATH")]))
    return env
