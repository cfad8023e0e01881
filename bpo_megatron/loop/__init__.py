"""The RL loop and what it needs around the algorithm: prompts, scoring, warm start, run state."""
