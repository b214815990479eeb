"""memexp's training entry point: `python train.py [overrides]` (see README)."""

import sys

from hydra_plugins.memexp_launcher import server

if __name__ == "__main__":
    # A sweep's preloaded server starts before the imports below, to import beside them.
    server.start_early(sys.argv[1:])
    from memexp.app import main

    main()
