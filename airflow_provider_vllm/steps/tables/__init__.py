"""Iceberg tables in and out (pyiceberg, imported lazily): which tables a deployment allows, the input snapshot
resolved to Parquet files for the shards, and the publish commit. See docs/adr/0009-iceberg-tables.md."""
