"""The selfspec demo, end to end on a laptop CPU: `make demo` (`python scripts/demo.py --help`).

The library module train/demo.py does the work; this file only calls it.
"""

from train.demo import main

raise SystemExit(main())
