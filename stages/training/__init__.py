"""Pieces every training stage shares: learning-rate schedules, the per-step log, seeding."""
