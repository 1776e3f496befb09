"""`python -m decode_worker --model DIR ...` (the same flags as `kimi-pd decode`)."""
import sys

from decode_worker import ROLE
from worker.cli import main

sys.exit(main(ROLE))
