"""memexp's training entry point: `python train.py [overrides]` (see README)."""

from memexp.app import main

if __name__ == "__main__":
    main()
