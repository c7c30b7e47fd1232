"""RL objectives."""
