"""memexp's Hydra launchers: hydra-submitit-launcher's, made to survive their own jobs."""
