import sys

from mm_assets.orchestration.cli import main

sys.exit(main())
