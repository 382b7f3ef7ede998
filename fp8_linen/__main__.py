"""``python -m fp8_linen``: forwards to the main job in :mod:`fp8_linen_job`."""

import sys

if __name__ == '__main__':
  from fp8_linen_job import main  # the job sits above the library; only this entry point reaches it

  sys.exit(main.main())
