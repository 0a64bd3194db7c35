"""`python -m proxy` is the `mcp-tasks-proxy` command."""

import sys

from proxy.cli import main

sys.exit(main())
