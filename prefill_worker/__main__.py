"""`python -m prefill_worker --model DIR ...` (the same flags as `kimi-pd prefill`)."""
import sys

from prefill_worker import ROLE
from worker.cli import main

sys.exit(main(ROLE))
