"""Serving: the requests' lives, admission and the one scheduler, building and rebuilding rings (recovery, drain, live
moves), the prefix cache's index, spot checks, and each request's timing and history."""
