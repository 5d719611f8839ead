"""Offline demo assets: synthetic chat datasets and tiny random-weight targets built locally."""
