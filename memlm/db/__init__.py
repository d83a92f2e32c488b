"""Storage of the service: SQLAlchemy models, repositories, migrations helpers."""
