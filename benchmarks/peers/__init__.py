"""Other projects' activation-checkpointing planners, wrapped to run as peer rows in the benchmarks."""
