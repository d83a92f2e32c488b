"""The HTTP front door of memlm (FastAPI). Build the app with ``service.app.create_app``."""
