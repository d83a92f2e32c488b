"""Routes by domain: documents, inference, admin, health."""
