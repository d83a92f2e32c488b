"""The operator's dashboard: ``GET /dashboard`` and its data, ``GET /admin/stats/history``."""
