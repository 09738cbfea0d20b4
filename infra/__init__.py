"""The infrastructure the method stands on, read only when needed: options and their validation, output folders,
checkpoints, run records, trackers, timelines, ranks and liveness, process plumbing, tasks, data, models and
rewards. Imports nothing from the top level but config.py."""
