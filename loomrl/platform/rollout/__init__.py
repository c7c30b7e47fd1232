"""Rollout engines behind one seam (see base.py)."""
