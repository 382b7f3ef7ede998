"""``python -m fp8_linen``: runs the main job (see :mod:`fp8_linen.job.main`)."""

import sys

from fp8_linen.job import main

if __name__ == '__main__':
  sys.exit(main.main())
