"""``python -m fp8_linen_job``: runs the main job (see :mod:`fp8_linen_job.main`)."""

import sys

from fp8_linen_job import main

if __name__ == '__main__':
  sys.exit(main.main())
