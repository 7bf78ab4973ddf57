"""The working directory: its manifest and files, the snapshot inventory, setup and verify."""
