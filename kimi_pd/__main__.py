import sys

from kimi_pd.cli import main

sys.exit(main())
