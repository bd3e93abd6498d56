"""`python -m pagedllm ...` runs the `pagedllm` command."""

import sys

from pagedllm.cli import main

sys.exit(main())
