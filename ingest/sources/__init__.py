"""Sources: listing files (local, object stores, ``datasets`` folders), their formats (Parquet,
Arrow IPC, JSON Lines), reading a unit's texts, and decoded row groups kept on disk."""
