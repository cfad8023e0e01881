"""Tasks: problems turned into prompts and requests, responses turned into rewards.

Shared by the RL loop and evaluation (both sit above this package); nothing here knows about
training.
"""
