from __future__ import annotations

import sys

from tangram_env.server.cli import main

sys.exit(main())
