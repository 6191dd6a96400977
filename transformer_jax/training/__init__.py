"""Training: losses, learning-rate schedules, optimizer, train state, steps and loop."""
