"""Running a pipeline stage: the executor of a rank's lowered actions (executor.py) and
the timeline recorded from a real run (timeline.py)."""
