"""Background processes of memlm: the ingest worker, the index builder, the scheduler."""
