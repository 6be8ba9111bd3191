"""python -m engine.serving --weights DIR ...: the OpenAI-compatible server (engine.serving.server)."""

import sys

from engine.serving.server import main

sys.exit(main())
