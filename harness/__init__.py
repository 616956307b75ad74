"""harness: verify numerics, communication and throughput of distributed training changes."""

import time as _time

__version__ = "0.1.0"
# When this process first imported harness, before anything heavy: where its timeline starts (phases.py).
IMPORTED_AT = _time.time()
