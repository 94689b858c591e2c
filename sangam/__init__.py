"""Sangam."""
