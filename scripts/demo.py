"""The selfspec demo, end to end on a laptop CPU: `make demo` (`python scripts/demo.py --help`).

The library module train/apps/demo.py does the work; this file only calls it.
"""

from train.apps.demo import main

raise SystemExit(main())
