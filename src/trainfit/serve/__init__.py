"""`trainfit serve`: the estimator and the planner in a local web page (api.py answers, server.py
speaks HTTP, page.html draws)."""
