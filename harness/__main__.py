import gc

gc.disable()  # until the imports are done and frozen: see harness.cli.main

from harness.cli import main  # noqa: E402

raise SystemExit(main())
