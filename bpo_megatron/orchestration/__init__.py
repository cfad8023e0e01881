"""Where actors run: Ray start-up, the trainer and engine actor groups, weight sync."""
